//! Mixtures of experts: a router picks each row's experts on the host, each expert runs once over the rows that
//! chose it, and the rows' outputs are summed in the order of their choices (Qwen3-MoE, Qwen3-Next with its
//! gated shared expert).

use super::decoder::Scratch;
use crate::backend::Backend;
use crate::bundle::hparams::HParams;

/// Qwen3-Next's shared expert: a gated MLP every token runs, scaled by the sigmoid of `weight · x̂`.
pub(super) struct SharedExpert<B: Backend> {
    pub(super) mlp: [B::Matrix; 3],
    pub(super) weight: B::Matrix,
}

/// A row's experts and their weights from its router logits: the softmax's `top_k` largest (the lower index
/// first among equals), in decreasing order, renormalized to sum to 1 when `norm`.
fn route(logits: &[f32], top_k: usize, norm: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let total: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    let chosen: Vec<(usize, f32)> = order[..top_k]
        .iter()
        .map(|&e| (e, exp[e] / total))
        .collect();
    if !norm {
        return chosen;
    }
    let sum: f32 = chosen.iter().map(|c| c.1).sum();
    chosen.into_iter().map(|(e, p)| (e, p / sum)).collect()
}

/// The mixture of experts over `rows` rows of `s.x`, added to it. The router's logits come back to the host,
/// which picks each row's experts and weights (softmax, top k, renormalized if the model says so); each
/// expert then runs once over the rows that chose it, gathered, and each row's outputs are summed in the
/// order of its choices, then the shared expert's output where there is one, scaled by its gate. Every
/// row's arithmetic is its own — the projections are row-exact and the host work is per row — so a row's
/// result is bitwise the same whatever rows share the forward and whichever experts they chose. (The host
/// round trips keep such forwards from being recorded; see `run`.)
#[allow(clippy::too_many_arguments)] // the mixture's parts and the rows
pub(super) fn mixture<B: Backend>(
    be: &B,
    hp: &HParams,
    ffn_norm: &B::Buffer,
    router: &B::Matrix,
    experts: &[[B::Matrix; 3]],
    shared: Option<&SharedExpert<B>>,
    s: &mut Scratch<B>,
    rows: usize,
) {
    let m = hp
        .block
        .moe
        .as_ref()
        .expect("a sparse layer's model has a mixture");
    let h = hp.hidden;
    be.rms_norm(&s.x, ffn_norm, rows, h, hp.rms_eps, &mut s.xn);
    be.matmul(router, &s.xn, rows, &mut s.router);
    let logits = be.download(&s.router, rows * m.experts);
    let choices: Vec<Vec<(usize, f32)>> = logits
        .chunks_exact(m.experts)
        .map(|l| route(l, m.top_k, m.norm_top_k))
        .collect();
    let xn = be.download(&s.xn, rows * h);
    // outs[(row * top_k + choice) * h ..]: a row's expert outputs in the order of its choices.
    let mut outs = vec![0f32; rows * m.top_k * h];
    for (e, [gate, up, down]) in experts.iter().enumerate() {
        let mine: Vec<(usize, usize)> = (0..rows)
            .flat_map(|r| choices[r].iter().position(|&(x, _)| x == e).map(|k| (r, k)))
            .collect();
        if mine.is_empty() {
            continue;
        }
        let gathered: Vec<f32> = mine
            .iter()
            .flat_map(|&(r, _)| xn[r * h..(r + 1) * h].iter().copied())
            .collect();
        be.write(&mut s.gathered, &gathered);
        let n = mine.len();
        be.glu_matmul(&s.gathered, None, n, gate, up, hp.block.glu, &mut s.act);
        be.matmul(down, &s.act, n, &mut s.tmp);
        let y = be.download(&s.tmp, n * h);
        for (i, &(r, k)) in mine.iter().enumerate() {
            outs[(r * m.top_k + k) * h..][..h].copy_from_slice(&y[i * h..(i + 1) * h]);
        }
    }
    // The shared expert's output of every row, and its gate's sigmoid.
    let shared_out = shared.map(|sh| {
        let [gate, up, down] = &sh.mlp;
        be.glu_matmul(&s.xn, None, rows, gate, up, hp.block.glu, &mut s.act);
        be.matmul(down, &s.act, rows, &mut s.tmp);
        be.matmul(&sh.weight, &s.xn, rows, &mut s.router);
        let y = be.download(&s.tmp, rows * h);
        let g: Vec<f32> = be
            .download(&s.router, rows)
            .into_iter()
            .map(|g| 1.0 / (1.0 + (-g).exp()))
            .collect();
        (y, g)
    });
    let mut x = be.download(&s.x, rows * h);
    for (r, xr) in x.chunks_exact_mut(h).enumerate() {
        for (j, v) in xr.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (k, &(_, w)) in choices[r].iter().enumerate() {
                acc += w * outs[(r * m.top_k + k) * h + j];
            }
            if let Some((y, g)) = &shared_out {
                acc += g[r] * y[r * h + j];
            }
            *v += acc;
        }
    }
    be.write(&mut s.x, &x);
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn a_row_takes_its_top_k_experts_by_softmax_weight_lower_index_first_among_equals() {
        let logits = [0.0, 2.0, 1.0, 2.0];
        let chosen = route(&logits, 2, false);
        assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 3]);
        let total: f32 = logits.iter().map(|&l| (l - 2.0f32).exp()).sum();
        assert_eq!(chosen[0].1, 1.0 / total);
        // Renormalized over the chosen two: equal logits, equal halves.
        let norm = route(&logits, 2, true);
        assert_eq!((norm[0].1, norm[1].1), (0.5, 0.5));
        let three = route(&logits, 3, true);
        assert_eq!(three.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((three.iter().map(|c| c.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
