//! Gated DeltaNet layers (Qwen3-Next's linear attention): the input projections on the device, then per row
//! on the host a short causal convolution over the Q/K/V channels and the gated delta rule, which folds each
//! token into one `key_dim × value_dim` state per value head; the gated output norm; the output projection on
//! the device, added to the residual stream.
//!
//! Exactness: the rows of a forward are stepped one after another, each from its parent's state (the row
//! before it, or its parent in a draft tree) with the same arithmetic, so a W-row verify gives every row
//! bitwise what W one-row steps give, and a prompt gives the same states however it is chunked. The host
//! round trip keeps such forwards out of recorded graphs; a device kernel for the recurrence would bring them
//! back (it must keep the row order to keep the contract).

use super::decoder::Scratch;
use crate::backend::Backend;
use crate::bundle::hparams::{HParams, LinearAttention};
use crate::bundle::{Bundle, TensorKey};
use crate::cache::Recurrent;
use crate::error::{Error, Result};

/// How a checkpoint stores the input projection of Q, K, V and Z (the output gate).
enum InputProjection<B: Backend> {
    /// Per key head: its Q and K, then the V and Z of the value heads it serves (Qwen3-Next's checkpoints,
    /// llama.cpp's first qwen3next GGUFs).
    Grouped(B::Matrix),
    /// Every key head's Q, then every K, then every value head's V — the convolution's channels in order —;
    /// and every value head's Z (Qwen3.5's checkpoints, llama.cpp's current GGUFs).
    Split { qkv: B::Matrix, z: B::Matrix },
}

/// One Gated DeltaNet layer's weights.
pub(super) struct DeltaNet<B: Backend> {
    input: InputProjection<B>,
    /// Per key head: β then α of the value heads it serves.
    ba: B::Matrix,
    pub(super) out: B::Matrix,
    /// The convolution's taps, `kernel` per channel (the oldest input's first).
    conv: Vec<f32>,
    /// Per value head: `-exp(A_log)`, the decay rate's scale (GGUFs store it so).
    decay: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated output norm's weights (`value_dim`; plain, not offset by 1).
    norm: Vec<f32>,
}

impl<B: Backend> DeltaNet<B> {
    pub(super) fn load(bundle: &Bundle, hp: &HParams, l: usize, be: &B) -> Result<(Self, usize)> {
        let la = linear(hp);
        let h = hp.hidden;
        let (kd, vd) = (la.key_heads * la.key_dim, la.value_heads * la.value_dim);
        let mut bytes = 0;
        let mut mat = |key: TensorKey, rows: usize, cols: usize| -> Result<B::Matrix> {
            let m = be.load_matrix(bundle.matrix(key, rows, cols)?)?;
            bytes += be.matrix_bytes(&m);
            Ok(m)
        };
        let input = if bundle.has(TensorKey::LinearQkvz(l)) {
            InputProjection::Grouped(mat(TensorKey::LinearQkvz(l), 2 * kd + 2 * vd, h)?)
        } else {
            InputProjection::Split {
                qkv: mat(TensorKey::LinearQkv(l), 2 * kd + vd, h)?,
                z: mat(TensorKey::LinearZ(l), vd, h)?,
            }
        };
        let ba = mat(TensorKey::LinearBa(l), 2 * la.value_heads, h)?;
        let out = mat(TensorKey::LinearOut(l), h, vd)?;
        let conv = bundle.values(
            TensorKey::LinearConv(l),
            &[la.conv_channels(), 1, la.conv_kernel],
        )?;
        // transformers computes `-A_log.float().exp()` in f32; llama.cpp's converter stores that.
        let a = bundle.vector(TensorKey::LinearALog(l), la.value_heads)?;
        let decay = if bundle.is_gguf() {
            a
        } else {
            a.iter().map(|a| -a.exp()).collect()
        };
        let dt_bias = bundle.vector(TensorKey::LinearDtBias(l), la.value_heads)?;
        let norm = bundle.vector(TensorKey::LinearNorm(l), la.value_dim)?;
        if [&conv, &dt_bias, &norm]
            .iter()
            .any(|v| v.iter().any(|x| !x.is_finite()))
        {
            return Err(Error::tensor(
                format!("layer {l}'s linear attention"),
                "has values that are not finite",
            ));
        }
        Ok((
            DeltaNet {
                input,
                ba,
                out,
                conv,
                decay,
                dt_bias,
                norm,
            },
            bytes,
        ))
    }

    /// The layer's mixer over `rows` rows of `s.x` (normed with `attn_norm`): the output, before its
    /// projection, in `s.attn` (`value_heads × value_dim` per row). Row `r` steps from the state after row
    /// `parents[r]` (`None`: the state before the forward); the states after the rows go to `states` (layer
    /// `l`).
    #[allow(clippy::too_many_arguments)] // the layer's inputs, its place and its state
    pub(super) fn run(
        &self,
        be: &B,
        hp: &HParams,
        attn_norm: &B::Buffer,
        s: &mut Scratch<B>,
        rows: usize,
        parents: &[Option<usize>],
        l: usize,
        states: &mut Recurrent,
    ) {
        let la = linear(hp);
        let (kd, vd) = (la.key_heads * la.key_dim, la.value_heads * la.value_dim);
        let (channels, width_ba) = (2 * kd + vd, 2 * la.value_heads);
        let norm = Some((attn_norm, hp.rms_eps));
        // Each row's convolution input (Q, K, V channels in order) and output gates.
        let (x, z) = match &self.input {
            InputProjection::Grouped(qkvz) => {
                be.matmuls(
                    &s.x,
                    norm,
                    rows,
                    &mut [(qkvz, &mut s.act), (&self.ba, &mut s.router)],
                );
                let grouped = be.download(&s.act, rows * (channels + vd));
                ungroup(la, &grouped, rows)
            }
            InputProjection::Split { qkv, z } => {
                be.matmuls(
                    &s.x,
                    norm,
                    rows,
                    &mut [
                        (qkv, &mut s.act),
                        (z, &mut s.attn),
                        (&self.ba, &mut s.router),
                    ],
                );
                (
                    be.download(&s.act, rows * channels),
                    be.download(&s.attn, rows * vd),
                )
            }
        };
        let ba = be.download(&s.router, rows * width_ba);
        let mut out = vec![0f32; rows * vd];
        for r in 0..rows {
            let (from, mut to) = states.step(l, r, parents[r]);
            self.step(
                la,
                hp.rms_eps,
                &x[r * channels..(r + 1) * channels],
                &z[r * vd..(r + 1) * vd],
                &ba[r * width_ba..(r + 1) * width_ba],
                from,
                &mut to,
                &mut out[r * vd..(r + 1) * vd],
            );
            states.stepped(l, r, to);
        }
        be.write(&mut s.attn, &out);
    }

    /// One token (its convolution input `x`, output gates `z`, and β/α grouped by key head): fold it into the
    /// state `from` (the convolution's last inputs, then each value head's matrix), writing the state after it
    /// whole to `to`, and write the gated, normed output of every value head to `out`. Out of place: the state
    /// before stays as it was (a rollback's), and each state value is read twice and written once.
    #[allow(clippy::too_many_arguments)] // one token's inputs, its states and its output
    fn step(
        &self,
        la: &LinearAttention,
        eps: f32,
        x: &[f32],
        z: &[f32],
        ba: &[f32],
        from: &[f32],
        to: &mut [f32],
        out: &mut [f32],
    ) {
        let (nk, nv, dk, dv, taps) = (
            la.key_heads,
            la.value_heads,
            la.key_dim,
            la.value_dim,
            la.conv_kernel,
        );
        let per_key = nv / nk;
        let channels = la.conv_channels();
        let mut x = x.to_vec();
        // β and α of each value head (grouped by key head in every format).
        let (mut beta, mut alpha) = (vec![0f32; nv], vec![0f32; nv]);
        for g in 0..nk {
            for j in 0..per_key {
                beta[g * per_key + j] = ba[g * 2 * per_key + j];
                alpha[g * per_key + j] = ba[g * 2 * per_key + per_key + j];
            }
        }
        let conv_len = channels * (taps - 1);
        let (conv_before, heads_before) = from.split_at(conv_len);
        let (conv_after, heads_after) = to.split_at_mut(conv_len);
        // Causal convolution with SiLU; the state keeps each channel's last `taps - 1` inputs, oldest first.
        for (c, xc) in x.iter_mut().enumerate() {
            let w = &self.conv[c * taps..(c + 1) * taps];
            let past = &conv_before[c * (taps - 1)..(c + 1) * (taps - 1)];
            let mut acc = 0f32;
            for (j, &p) in past.iter().enumerate() {
                acc += w[j] * p;
            }
            acc += w[taps - 1] * *xc;
            if taps > 1 {
                let kept = &mut conv_after[c * (taps - 1)..(c + 1) * (taps - 1)];
                kept[..taps - 2].copy_from_slice(&past[1..]);
                kept[taps - 2] = *xc;
            }
            *xc = silu(acc);
        }
        let (q, rest) = x.split_at_mut(nk * dk);
        let (k, v) = rest.split_at_mut(nk * dk);
        let scale = (dk as f32).sqrt();
        for (qh, kh) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
            l2_normalize(qh);
            l2_normalize(kh);
            qh.iter_mut().for_each(|e| *e /= scale);
        }
        let (mut kv_mem, mut delta) = (vec![0f32; dv], vec![0f32; dv]);
        for h in 0..nv {
            let g = h / per_key;
            let (qh, kh) = (&q[g * dk..(g + 1) * dk], &k[g * dk..(g + 1) * dk]);
            let vh = &v[h * dv..(h + 1) * dv];
            let s = &heads_before[h * dk * dv..(h + 1) * dk * dv];
            let s_after = &mut heads_after[h * dk * dv..(h + 1) * dk * dv];
            let decay = (self.decay[h] * softplus(alpha[h] + self.dt_bias[h])).exp();
            let b = sigmoid(beta[h]);
            // With S the decayed state (S[i][j] = decay · S_before[i][j], formed alike in both passes):
            // kv_mem[j] = Σ_i S[i][j] k[i]; S'[i][j] = S[i][j] + k[i] (v[j] - kv_mem[j]) β; o[j] = Σ_i S'[i][j] q[i].
            kv_mem.iter_mut().for_each(|e| *e = 0.0);
            for (i, &ki) in kh.iter().enumerate() {
                for (m, &sij) in kv_mem.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *m += (sij * decay) * ki;
                }
            }
            for ((d, &vj), &m) in delta.iter_mut().zip(vh).zip(&kv_mem) {
                *d = (vj - m) * b;
            }
            let o = &mut out[h * dv..(h + 1) * dv];
            o.iter_mut().for_each(|e| *e = 0.0);
            for (i, (&ki, &qi)) in kh.iter().zip(qh).enumerate() {
                let before = &s[i * dv..(i + 1) * dv];
                let after = &mut s_after[i * dv..(i + 1) * dv];
                for (((sa, &sij), &dj), oj) in
                    after.iter_mut().zip(before).zip(&delta).zip(o.iter_mut())
                {
                    *sa = sij * decay + ki * dj;
                    *oj += *sa * qi;
                }
            }
            // The gated RMS norm: norm(o) · w · silu(z).
            let ms = o.iter().map(|e| e * e).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            let zh = &z[h * dv..(h + 1) * dv];
            for ((oj, &wj), &zj) in o.iter_mut().zip(&self.norm).zip(zh) {
                *oj = wj * (*oj * inv) * silu(zj);
            }
        }
    }
}

/// Rows of the grouped Q/K/V/Z projection as the convolution's input (every key head's Q, then every K,
/// then every value head's V) and the value heads' output gates, `rows` of each.
fn ungroup(la: &LinearAttention, grouped: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
    let (nk, dk, dv) = (la.key_heads, la.key_dim, la.value_dim);
    let per_key = la.value_heads / nk;
    let (group, channels, vd) = (
        2 * dk + 2 * per_key * dv,
        la.conv_channels(),
        la.value_heads * dv,
    );
    let (mut x, mut z) = (vec![0f32; rows * channels], vec![0f32; rows * vd]);
    for r in 0..rows {
        let (xr, zr) = (&mut x[r * channels..][..channels], &mut z[r * vd..][..vd]);
        for g in 0..nk {
            let src = &grouped[r * (channels + vd) + g * group..][..group];
            xr[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
            xr[(nk + g) * dk..(nk + g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
            let (v, zs) = src[2 * dk..].split_at(per_key * dv);
            xr[2 * nk * dk + g * per_key * dv..][..per_key * dv].copy_from_slice(v);
            zr[g * per_key * dv..(g + 1) * per_key * dv].copy_from_slice(zs);
        }
    }
    (x, z)
}

fn linear(hp: &HParams) -> &LinearAttention {
    hp.block
        .linear
        .as_ref()
        .expect("a linear-attention layer's model has its shape")
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 as PyTorch's is.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(Σ x² + 1e-6)` (the FLA library's and transformers' l2 norm).
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|e| e * e).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|e| *e *= inv);
}
