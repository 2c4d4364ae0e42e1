//! The batched-forward checks shared by the CPU and GPU tests: sequences in one forward (a prefill, a verify, a
//! draft tree, a chunk whose last row alone has logits, a step without any, each with the target states its
//! proposer would ask for) against each one's own forward; several requests' MTP drafts in one batched call
//! against each one's own.

use verity::backend::{AttnMask, Backend};
use verity::cache::KvCache;
use verity::model::{
    Batch, BlockDraft, BlockDrafter, ForwardOutput, HeadDraft, LogitRows, Model, MtpHead,
    SeqForward, TargetFeatures,
};

/// One sequence's case: the prefix already in its cache, then the rows of the step under test and the target
/// states its proposer would ask for.
struct Case {
    prefix: Vec<u32>,
    batch: Batch,
    logits: LogitRows,
    features: TargetFeatures,
}

/// A draft tree after `base` committed tokens: row 0 the pending token, rows 1 and 2 its children, 3 a child of
/// 1, 4 a child of 2.
fn tree(tokens: [u32; 5], base: usize) -> Batch {
    let parents = [None, Some(0), Some(0), Some(1), Some(2)];
    let depth = |mut r: usize| {
        let mut d = 0;
        while let Some(p) = parents[r] {
            r = p;
            d += 1;
        }
        d
    };
    let mut visible = vec![false; 25];
    for i in 0..5 {
        let mut r = Some(i);
        while let Some(j) = r {
            visible[i * 5 + j] = true;
            r = parents[j];
        }
    }
    Batch {
        tokens: tokens.to_vec(),
        positions: (0..5).map(|r| base + depth(r)).collect(),
        mask: AttnMask::Tree(visible),
        media: Vec::new(),
        spatial: Vec::new(),
    }
}

fn cases(tokens: &[u32]) -> Vec<Case> {
    let t = |i: usize| tokens[i % tokens.len()];
    vec![
        // A prefill from empty, every row's logits.
        Case {
            prefix: Vec::new(),
            batch: Batch::causal(&tokens[..20], 0),
            logits: LogitRows::All,
            features: TargetFeatures::none(),
        },
        // A greedy verify of 4 rows after 12 tokens.
        Case {
            prefix: tokens[3..15].to_vec(),
            batch: Batch::causal(&tokens[15..19], 12),
            logits: LogitRows::Greedy,
            // An MTP head's.
            features: TargetFeatures::final_state(),
        },
        // A draft tree after 30 tokens.
        Case {
            prefix: (0..30).map(|i| t(i + 5)).collect(),
            batch: tree([t(1), t(2), t(3), t(4), t(6)], 30),
            logits: LogitRows::All,
            // A block drafter's and an MTP head's (a chooser over both).
            features: TargetFeatures {
                layers: vec![1, 0],
                final_state: true,
            },
        },
        // A prefill chunk of 3 rows after 7 tokens, the last row's logits only.
        Case {
            prefix: tokens[..7].to_vec(),
            batch: Batch::causal(&tokens[7..10], 7),
            logits: LogitRows::Last,
            // A block drafter's.
            features: TargetFeatures::layers(vec![0]),
        },
        // A one-row step, no logits (a prefix's last chunk).
        Case {
            prefix: tokens[20..24].to_vec(),
            batch: Batch::causal(&tokens[24..25], 4),
            logits: LogitRows::None,
            features: TargetFeatures::final_state(),
        },
    ]
}

/// A cache holding `prefix`.
fn primed<B: Backend>(model: &mut Model<B>, prefix: &[u32]) -> KvCache<B> {
    let mut cache = model.new_cache(256);
    if !prefix.is_empty() {
        model
            .forward(&mut cache, &Batch::causal(prefix, 0), LogitRows::None, &[])
            .unwrap();
    }
    cache
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn same(a: &ForwardOutput, b: &ForwardOutput) -> bool {
    bits(&a.logits) == bits(&b.logits)
        && a.greedy == b.greedy
        && bits(&a.features) == bits(&b.features)
}

fn cache_bits<B: Backend>(model: &Model<B>, cache: &KvCache<B>) -> Vec<Vec<u32>> {
    let ckpt = cache.checkpoint(model.backend());
    ckpt.layers()
        .iter()
        .flat_map(|(k, v)| [bits(k), bits(v)])
        .collect()
}

/// Each case alone, then all in one batched forward (three times: reordered, with a case left out, and with only
/// the steps and verifies): outputs and caches bitwise equal.
pub fn assert_batched_equals_alone<B: Backend>(model: &mut Model<B>, tokens: &[u32], label: &str) {
    let cases = cases(tokens);
    let mut alone = Vec::new();
    for c in &cases {
        let mut cache = primed(model, &c.prefix);
        let out = model
            .forward_features(&mut cache, &c.batch, c.logits, &c.features)
            .unwrap();
        alone.push((out, cache_bits(model, &cache)));
    }
    // The third order holds no prefill: every sequence is a step or a verify (a device shares their launches).
    for order in [vec![0, 1, 2, 3, 4], vec![3, 2, 4, 0], vec![4, 1, 3, 2]] {
        let mut caches: Vec<KvCache<B>> = order
            .iter()
            .map(|&i| primed(model, &cases[i].prefix))
            .collect();
        let mut seqs: Vec<SeqForward<B>> = caches
            .iter_mut()
            .zip(&order)
            .map(|(cache, &i)| SeqForward {
                cache,
                batch: &cases[i].batch,
                logits: cases[i].logits,
                features: cases[i].features.clone(),
            })
            .collect();
        let outs = model.forward_batched(&mut seqs).unwrap();
        drop(seqs);
        for ((out, cache), &i) in outs.iter().zip(&caches).zip(&order) {
            assert!(
                same(out, &alone[i].0),
                "{label}: case {i} output differs from its own forward"
            );
            assert!(
                cache_bits(model, cache) == alone[i].1,
                "{label}: case {i} cache differs from its own forward's"
            );
        }
    }
}

/// Several requests' greedy MTP drafts in one batched call against each one's own chained draft: requests with
/// catch-ups of different lengths (one after an earlier catch-up already in its head cache, one of a single
/// row) and different depths (1 to 6) get bitwise their own tokens and head caches; run twice, the second time
/// with the requests reordered and one left out.
pub fn assert_batched_head_drafts_equal_alone<B: Backend>(
    model: &mut Model<B>,
    head: &mut MtpHead<B>,
    tokens: &[u32],
    label: &str,
) {
    let h = model.hp.hidden;
    let mut cache = model.new_cache(256);
    let hidden = model
        .forward_with_hidden(&mut cache, &Batch::causal(tokens, 0), LogitRows::None)
        .unwrap()
        .final_hidden;
    // (head cache prefix: positions 1..=p caught up before; catch-up positions p+1..=n; depth)
    let cases = [(0, 7, 4), (3, 9, 1), (5, 6, 6), (0, 1, 3), (8, 12, 2)];
    let prime = |head: &mut MtpHead<B>, p: usize| {
        let mut hc = head.new_cache(64);
        if p > 0 {
            head.draft_greedy(&mut hc, &tokens[1..=p], 1, &hidden[..p * h], 1)
                .unwrap();
            // The draft's own slot is not kept (a proposer truncates to the committed mark).
            hc.truncate(p);
        }
        hc
    };
    let catch_up = |p: usize, n: usize| (&tokens[p + 1..=n], &hidden[p * h..n * h]);
    let mut alone = Vec::new();
    for &(p, n, depth) in &cases {
        let mut hc = prime(head, p);
        let (t, hid) = catch_up(p, n);
        let drafted = head.draft_greedy(&mut hc, t, p + 1, hid, depth).unwrap();
        alone.push((drafted, cache_bits(model, &hc)));
    }
    for order in [vec![0, 1, 2, 3, 4], vec![4, 2, 0, 3]] {
        let mut caches: Vec<KvCache<B>> = order.iter().map(|&i| prime(head, cases[i].0)).collect();
        let mut jobs: Vec<HeadDraft<B>> = order
            .iter()
            .zip(caches.iter_mut())
            .map(|(&i, hc)| {
                let (p, n, depth) = cases[i];
                let (t, hid) = catch_up(p, n);
                HeadDraft::new(hc, t, p + 1, hid, depth)
            })
            .collect();
        let drafted = head.draft_greedy_batched(&mut jobs).unwrap();
        drop(jobs);
        for ((&i, d), hc) in order.iter().zip(&drafted).zip(&caches) {
            assert_eq!(d, &alone[i].0, "{label}: request {i}'s tokens in {order:?}");
            assert!(
                cache_bits(model, hc) == alone[i].1,
                "{label}: request {i}'s head cache in {order:?}"
            );
        }
    }
}

/// Several requests' block drafts in one batched call against each one's own calls: contexts of different
/// lengths, each request with new context rows to add first (none, one, a few, more than a chunk) and widths from
/// 1 to the block's last row, get bitwise their own logits and context caches (`extend_context` then `draft`);
/// run twice, the second time with the requests reordered and one left out. `tokens`: 80 or more.
pub fn assert_batched_block_drafts_equal_alone<B: Backend>(
    model: &mut Model<B>,
    drafter: &mut BlockDrafter<B>,
    tokens: &[u32],
    label: &str,
) {
    let layers = drafter.spec().target_layers.clone();
    let mut cache = model.new_cache(256);
    let states = model
        .forward_features(
            &mut cache,
            &Batch::causal(tokens, 0),
            LogitRows::None,
            &TargetFeatures::layers(layers),
        )
        .unwrap()
        .features;
    let w = drafter.state_width();
    let most = drafter.spec().block - 1;
    // (position of the pending token, rows of context to add first, width)
    let cases = [
        (7, 1, most),
        (3, 0, 1),
        (12, 5, 2),
        (1, 1, most.min(3)),
        (9, 0, most),
        (78, 70, 2),
    ];
    // The context the cache holds before: positions 0..n - add.
    let held = |drafter: &mut BlockDrafter<B>, n: usize, add: usize| {
        let mut c = drafter.new_cache(128);
        if n > add {
            drafter
                .extend_context(&mut c, 0, &states[..(n - add) * w])
                .unwrap();
        }
        c
    };
    let fresh = |n: usize, add: usize| &states[(n - add) * w..n * w];
    let mut alone = Vec::new();
    for &(n, add, k) in &cases {
        let mut c = held(drafter, n, add);
        if add > 0 {
            drafter
                .extend_context(&mut c, n - add, fresh(n, add))
                .unwrap();
        }
        let logits = drafter.draft(&mut c, tokens[n], n, k).unwrap();
        alone.push((bits(&logits), cache_bits(model, &c)));
    }
    for order in [vec![0, 1, 2, 3, 4, 5], vec![5, 4, 2, 0, 3]] {
        let mut caches: Vec<KvCache<B>> = order
            .iter()
            .map(|&i| held(drafter, cases[i].0, cases[i].1))
            .collect();
        let mut jobs: Vec<BlockDraft<B>> = order
            .iter()
            .zip(caches.iter_mut())
            .map(|(&i, cache)| {
                let (n, add, k) = cases[i];
                BlockDraft {
                    cache,
                    context: fresh(n, add),
                    pending: tokens[n],
                    pos: n,
                    k,
                }
            })
            .collect();
        let drafted = drafter.draft_batched(&mut jobs).unwrap();
        drop(jobs);
        for ((&i, d), c) in order.iter().zip(&drafted).zip(&caches) {
            assert!(
                bits(d) == alone[i].0,
                "{label}: request {i}'s logits in {order:?}"
            );
            assert!(
                cache_bits(model, c) == alone[i].1,
                "{label}: request {i}'s context cache in {order:?}"
            );
        }
    }
}
