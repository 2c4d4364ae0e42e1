//! Local attention layers keep rings of their window: a model whose local layers' caches wrap many times
//! computes bitwise what it computes with whole-context caches, through forwards of any width, speculative
//! rollbacks, tree compaction and checkpoint restores, while holding a bounded number of slots; what a ring has
//! overwritten is never read (a truncation that would need it empties the cache).

mod common;

use common::*;
use verity::backend::cpu::CpuBackend;
use verity::backend::AttnMask;
use verity::cache::{CacheShape, KvCache};
use verity::model::{Batch, LogitRows, Model};

/// The tiny Gemma 3 bundle (window 8), allowed a longer context than its config's 256 so its rings wrap.
fn tiny_gemma() -> Model<CpuBackend> {
    let mut model = load_model_on(&hf_bundle("gemma3-f16"), f32_backend());
    assert_eq!(model.hp.layer_attention(0).0, Some(8));
    model.hp.context_len = 2048;
    model
}

fn whole_context_cache(model: &Model<CpuBackend>) -> KvCache<CpuBackend> {
    let hp = &model.hp;
    let shape = CacheShape {
        n_layers: hp.n_layers,
        n_heads: hp.n_heads,
        n_kv_heads: hp.n_kv_heads,
        head_dim: hp.head_dim,
    };
    KvCache::new(model.backend().as_ref(), shape, hp.context_len)
}

fn stream(n: usize) -> Vec<u32> {
    let reference = json(&hf_bundle("gemma3-f16").join("reference.json"));
    let ids = ids(&reference["token_ids"]);
    // Varied, not periodic: each pass over the reference ids shifted by its index.
    (0..n)
        .map(|i| (ids[i % ids.len()] + (i / ids.len()) as u32) % 320)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Run `batch` on both caches and require the same logits, bit for bit.
fn both(
    model: &mut Model<CpuBackend>,
    [ring, whole]: [&mut KvCache<CpuBackend>; 2],
    batch: &Batch,
    label: &str,
) {
    let a = model.forward(ring, batch, LogitRows::All, &[]).unwrap();
    let b = model.forward(whole, batch, LogitRows::All, &[]).unwrap();
    assert_eq!(bits(&a.logits), bits(&b.logits), "{label}");
}

#[test]
fn a_ring_cache_computes_what_a_whole_context_cache_computes() {
    let mut model = tiny_gemma();
    let tokens = stream(900);
    let mut ring = model.new_cache(2048);
    let mut whole = whole_context_cache(&model);
    // Forwards of many widths, some rejected in part (rolled back), some trees compacted.
    let widths = [64, 1, 3, 16, 7, 1, 1, 33, 5, 16, 2, 64, 9];
    let mut pos = 0;
    let mut step = 0;
    while pos + 70 < tokens.len() {
        let w = widths[step % widths.len()];
        let rows = &tokens[pos..pos + w];
        both(
            &mut model,
            [&mut ring, &mut whole],
            &Batch::causal(rows, pos),
            &format!("{w} rows at {pos}"),
        );
        // Every third forward keeps only part of its rows, as a rejected draft would.
        let keep = if step % 3 == 1 { w.div_ceil(2) } else { w };
        assert_eq!(
            ring.truncate(pos + keep),
            pos + keep,
            "a rollback within a forward"
        );
        whole.truncate(pos + keep);
        pos += keep;
        if step % 4 == 2 {
            // A draft tree: the pending token, two siblings, a child of the second; keep root → second → child.
            let t = &tokens[pos..pos + 4];
            let batch = Batch {
                tokens: vec![t[0], t[3], t[1], t[2]],
                positions: vec![pos, pos + 1, pos + 1, pos + 2],
                mask: AttnMask::Tree(vec![
                    true, false, false, false, //
                    true, true, false, false, //
                    true, false, true, false, //
                    true, false, true, true,
                ]),
                media: Vec::new(),
                spatial: Vec::new(),
            };
            both(
                &mut model,
                [&mut ring, &mut whole],
                &batch,
                &format!("tree at {pos}"),
            );
            let be = model.backend().clone();
            ring.keep_rows(be.as_ref(), pos, &[0, 2, 3]);
            whole.keep_rows(be.as_ref(), pos, &[0, 2, 3]);
            pos += 3;
            let next = &tokens[pos..pos + 2];
            both(
                &mut model,
                [&mut ring, &mut whole],
                &Batch::causal(next, pos),
                &format!("after the tree at {pos}"),
            );
            pos += 2;
        }
        step += 1;
    }
    assert!(pos > 800);
    // Bounded: the local layers hold a ring, the global ones everything.
    assert!(
        ring.bytes() <= whole.bytes() / 2,
        "{} bytes with rings, {} without",
        ring.bytes(),
        whole.bytes()
    );

    // A checkpoint holds each ring's last window; restored into a fresh cache it continues bitwise.
    let be = model.backend().clone();
    let ckpt = ring.checkpoint(be.as_ref());
    let mut restored = model.new_cache(2048);
    restored.restore(be.as_ref(), &ckpt).unwrap();
    let rest = &tokens[pos..pos + 20];
    both(
        &mut model,
        [&mut restored, &mut whole],
        &Batch::causal(rest, pos),
        "after a restore",
    );

    // A rollback far behind the ring's window cannot be served: the ring empties instead.
    assert_eq!(ring.truncate(pos - 400), 0);
    assert_eq!(whole.truncate(pos - 400), pos - 400);
}
