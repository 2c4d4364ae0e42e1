//! The CPU backend: f32 activations, weights kept in their stored format (memory-mapped), SIMD kernels chosen at
//! run time, and one persistent thread pool per backend.

mod attention;
#[cfg(target_arch = "x86_64")]
mod decode_x86;
mod math;
mod matmul;
mod ops;
mod packed;
mod pool;
mod q8;
mod qmatmul;
pub mod simd;

pub use math::{gelu_tanh_times, silu_times};
pub use matmul::{Activations, CpuMatrix};
use pool::Pool;

use std::sync::Mutex;

use crate::backend::{AttnMask, AttnShape, Backend, Glu, HeadNorms, Rope, StepInputs};
use crate::error::{Error, Result};
use crate::quant::QMatrix;

pub struct CpuBackend {
    pool: Pool,
    activations: Activations,
    /// Intermediate rows of the fused operations (grown once to the largest).
    temps: Mutex<Temps>,
}

/// Where the fused operations keep what a device without fusion materialises: the normed input and up to two
/// projections.
#[derive(Default)]
struct Temps {
    normed: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
}

fn at_least(v: &mut Vec<f32>, n: usize) -> &mut Vec<f32> {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    v
}

/// A forward's inputs, kept on the host.
pub struct CpuStep {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    spatial: Vec<[usize; 2]>,
    base: usize,
    mask: AttnMask,
    /// The rows' RoPE rotations, computed by the first layer of a forward and reused by the others (the angles
    /// are the same in every layer; computing them is costlier than applying them).
    rope: Mutex<RopeTable>,
}

/// A rotation of a step's rows: `(Rope::key, head_dim, rows)`.
type RopeKey = (u64, usize, usize);

/// `(cos, sin)` of every pair of every row, per rotation the step's layers use (a model with local layers has
/// two); cleared by `set_step`.
#[derive(Default)]
struct RopeTable {
    tables: Vec<(RopeKey, Vec<(f32, f32)>)>,
}

impl CpuBackend {
    /// A backend with `threads` threads (0 = one per available core) and the default activation precision:
    /// 8-bit for the formats that have integer kernels, unless `VERITY_ACTIVATIONS=f32` asks for the f32 path.
    pub fn new(threads: usize) -> Result<Self> {
        let acts = match std::env::var("VERITY_ACTIVATIONS").as_deref() {
            Ok("f32") => Activations::F32,
            Ok("q8") | Err(_) => Activations::Q8,
            Ok(other) => {
                return Err(Error::Invalid(format!(
                    "VERITY_ACTIVATIONS={other} (expected q8 or f32)"
                )))
            }
        };
        Self::with_activations(threads, acts)
    }

    pub fn with_activations(threads: usize, activations: Activations) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = Pool::new(threads)
            .map_err(|e| Error::Invalid(format!("cannot start {threads} threads: {e}")))?;
        Ok(CpuBackend {
            pool,
            activations,
            temps: Mutex::new(Temps::default()),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn activations(&self) -> Activations {
        self.activations
    }

    fn temps(&self) -> std::sync::MutexGuard<'_, Temps> {
        self.temps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `x`, or its RMS norm written into `normed`.
    fn normed<'a>(
        x: &'a [f32],
        norm: Option<(&Vec<f32>, f32)>,
        rows: usize,
        normed: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        match norm {
            None => x,
            Some((w, eps)) => {
                let dim = w.len();
                let out = at_least(normed, rows * dim);
                ops::rms_norm(x, w, rows, dim, eps, out);
                out
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Matrix = CpuMatrix;
    type Step = CpuStep;

    fn name(&self) -> String {
        format!(
            "cpu ({:?}, {:?} activations, {} threads)",
            simd::isa(),
            self.activations,
            self.threads()
        )
    }

    fn numerics(&self) -> String {
        // The f32 paths of the instruction sets reduce in different orders; the 8-bit kernels (`simd::int8_isa`)
        // and the thread count change no bit, so they are not part of it.
        format!(
            "cpu {} {:?} {:?} activations",
            std::env::consts::ARCH,
            simd::isa(),
            self.activations
        )
    }

    fn load_matrix(&self, m: QMatrix) -> Result<CpuMatrix> {
        Ok(CpuMatrix::new(m, self.activations))
    }

    /// As stored: lookups decode rows from the memory map, and no repacked copy (tens to hundreds of MB for a
    /// large vocabulary) is made.
    fn load_table(&self, m: QMatrix) -> Result<CpuMatrix> {
        Ok(CpuMatrix::new(m, Activations::F32))
    }

    fn matrix_bytes(&self, m: &CpuMatrix) -> usize {
        m.stored.nbytes()
    }

    fn buffer(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn write(&self, buf: &mut Vec<f32>, data: &[f32]) {
        buf[..data.len()].copy_from_slice(data);
    }

    fn download(&self, buf: &Vec<f32>, len: usize) -> Vec<f32> {
        buf[..len].to_vec()
    }

    fn step(&self, max_rows: usize) -> CpuStep {
        CpuStep {
            tokens: Vec::with_capacity(max_rows),
            positions: Vec::with_capacity(max_rows),
            spatial: Vec::new(),
            base: 0,
            mask: AttnMask::Causal,
            rope: Mutex::new(RopeTable::default()),
        }
    }

    fn set_step(&self, step: &mut CpuStep, inputs: StepInputs) {
        step.tokens.clear();
        step.tokens.extend_from_slice(inputs.tokens);
        step.positions.clear();
        step.positions.extend_from_slice(inputs.positions);
        step.spatial.clear();
        step.spatial.extend_from_slice(inputs.spatial);
        step.base = inputs.base;
        step.mask.clone_from(inputs.mask);
        step.rope
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .tables
            .clear();
    }

    fn embed(&self, table: &CpuMatrix, step: &CpuStep, rows: usize, out: &mut Vec<f32>) {
        let d = table.stored.cols;
        for (r, &t) in step.tokens[..rows].iter().enumerate() {
            table
                .stored
                .dequantize_row(t as usize, &mut out[r * d..(r + 1) * d]);
        }
    }

    fn matmul(&self, w: &CpuMatrix, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        matmul::matmul(&self.pool, w, x, rows, out)
    }

    fn encoder_matmul(&self, w: &CpuMatrix, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        matmul::encoder_matmul(&self.pool, w, x, rows, out)
    }

    fn matmul_add(&self, w: &CpuMatrix, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        let n = rows * w.stored.rows;
        let mut t = self.temps();
        let sums = at_least(&mut t.a, n);
        matmul::matmul(&self.pool, w, x, rows, sums);
        for (a, &b) in out[..n].iter_mut().zip(sums.iter()) {
            *a += b;
        }
    }

    fn matmuls(
        &self,
        x: &Vec<f32>,
        norm: Option<(&Vec<f32>, f32)>,
        rows: usize,
        outs: &mut [(&CpuMatrix, &mut Vec<f32>)],
    ) {
        let mut t = self.temps();
        let x = Self::normed(x, norm, rows, &mut t.normed);
        matmul::matmuls(&self.pool, x, rows, outs);
    }

    fn glu_matmul(
        &self,
        x: &Vec<f32>,
        norm: Option<(&Vec<f32>, f32)>,
        rows: usize,
        gate: &CpuMatrix,
        up: &CpuMatrix,
        act: Glu,
        out: &mut Vec<f32>,
    ) {
        let n = rows * gate.stored.rows;
        let mut t = self.temps();
        let Temps { normed, a, b } = &mut *t;
        let x = Self::normed(x, norm, rows, normed);
        if matmul::glu_packed(&self.pool, x, rows, gate, up, act, &mut out[..n]) {
            return;
        }
        let (g, u) = (&mut at_least(a, n)[..n], &mut at_least(b, n)[..n]);
        matmul::matmuls(&self.pool, x, rows, &mut [(gate, &mut *g), (up, &mut *u)]);
        ops::glu(act, g, u, &mut out[..n]);
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, s: f32) {
        x[..len].iter_mut().for_each(|v| *v *= s);
    }

    fn rms_norm_add(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
        _next: Option<(&Vec<f32>, f32)>,
    ) {
        ops::rms_norm_add(x, w, rows, dim, eps, out)
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, dim: usize) {
        for row in x[..rows * dim].chunks_exact_mut(dim) {
            for (a, &b) in row.iter_mut().zip(bias) {
                *a += b;
            }
        }
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        ops::rms_norm(x, w, rows, dim, eps, out)
    }

    fn rope_and_cache(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
        shape: AttnShape,
        rope: Rope,
        norms: Option<HeadNorms<'_, Vec<f32>>>,
        step: &CpuStep,
    ) {
        let (rows, hd) = (shape.rows, shape.head_dim);
        if let Some(n) = norms {
            ops::rms_norm_in_place(&mut q[..rows * shape.n_heads * hd], n.q, hd, n.eps);
            ops::rms_norm_in_place(&mut k[..rows * shape.n_kv_heads * hd], n.k, hd, n.eps);
        }
        let positions = &step.positions[..rows];
        let mut table = step.rope.lock().unwrap_or_else(|e| e.into_inner());
        let key = (rope.key(), hd, rows);
        let rotated = rope.rotated(hd);
        let at = match table.tables.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                let spatial = &step.spatial;
                let rotations = positions
                    .iter()
                    .enumerate()
                    .flat_map(|(r, &pos)| {
                        let [h, w] = spatial.get(r).copied().unwrap_or([pos; 2]);
                        (0..rotated / 2).map(move |i| rope.angle_at([pos, h, w], i, rotated))
                    })
                    .collect();
                table.tables.push((key, rotations));
                table.tables.len() - 1
            }
        };
        let rotations = &table.tables[at].1;
        ops::rope(q, rotations, rows, shape.n_heads, hd, rope.style);
        ops::rope(k, rotations, rows, shape.n_kv_heads, hd, rope.style);
        let kv_dim = shape.n_kv_heads * hd;
        // A ring's slot j is at j mod its slots (a local layer's cache).
        let slots = k_cache.len() / kv_dim;
        for r in 0..rows {
            let at = (step.base + r) % slots * kv_dim;
            let row = r * kv_dim..(r + 1) * kv_dim;
            k_cache[at..at + kv_dim].copy_from_slice(&k[row.clone()]);
            v_cache[at..at + kv_dim].copy_from_slice(&v[row]);
        }
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        _work: &mut Vec<f32>,
        shape: AttnShape,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) {
        attention::attention(
            &self.pool,
            q,
            k,
            v,
            shape,
            step.base,
            &step.positions,
            &step.mask,
            out,
        )
    }

    fn argmax(&self, x: &Vec<f32>, rows: usize, n: usize, out: &mut Vec<f32>) {
        for (o, row) in out[..rows].iter_mut().zip(x.chunks_exact(n)) {
            *o = crate::sample::argmax(row) as f32;
        }
    }

    fn draft_token(
        &self,
        src: &Vec<f32>,
        table: Option<&Vec<f32>>,
        log: &mut Vec<f32>,
        at: usize,
        step: Option<&mut CpuStep>,
    ) {
        let i = src[0] as usize;
        let token = table.map_or(i as f32, |t| t[i]);
        log[at] = token;
        if let Some(step) = step {
            step.tokens[0] = token as u32;
        }
    }

    fn copy(&self, src: &Vec<f32>, src_off: usize, dst: &mut Vec<f32>, dst_off: usize, len: usize) {
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
    }

    fn copy_within(&self, buf: &mut Vec<f32>, src_off: usize, dst_off: usize, len: usize) {
        assert!(
            dst_off + len <= src_off || src_off + len <= dst_off,
            "copy_within ranges overlap"
        );
        buf.copy_within(src_off..src_off + len, dst_off);
    }
}
