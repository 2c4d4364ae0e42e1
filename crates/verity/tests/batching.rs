//! Several sequences in one forward (what continuous batching runs): every sequence's logits, argmaxes, target
//! states (its proposer's features) and cache are bitwise what its own forward gives — a prefill, a verify, a draft tree, a chunk whose last row
//! alone has logits and a step without any side by side, on the 8-bit and f32 paths, a mixture of experts,
//! local attention layers and a hybrid with recurrent layers.

mod common;

use std::sync::Arc;

use common::*;
use verity::backend::cpu::CpuBackend;
use verity::backend::AttnMask;
use verity::cache::KvCache;
use verity::chat::Message;
use verity::engine::{Decoding, Engine, GenerateRequest, StopReason};
use verity::model::{Batch, ForwardOutput, LogitRows, Model, SeqForward, TargetFeatures};
use verity::speculative::SpecMode;

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
fn primed(model: &mut Model<CpuBackend>, prefix: &[u32]) -> KvCache<CpuBackend> {
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

fn cache_bits(model: &Model<CpuBackend>, cache: &KvCache<CpuBackend>) -> Vec<Vec<u32>> {
    let ckpt = cache.checkpoint(model.backend());
    ckpt.layers()
        .iter()
        .flat_map(|(k, v)| [bits(k), bits(v)])
        .collect()
}

/// Each case alone, then all in one batched forward (twice, the second time with the batch reordered and a
/// case left out): outputs and caches bitwise equal.
fn assert_batched_equals_alone(model: &mut Model<CpuBackend>, tokens: &[u32], label: &str) {
    let cases = cases(tokens);
    let mut alone = Vec::new();
    for c in &cases {
        let mut cache = primed(model, &c.prefix);
        let out = model
            .forward_features(&mut cache, &c.batch, c.logits, &c.features)
            .unwrap();
        alone.push((out, cache_bits(model, &cache)));
    }
    for order in [vec![0, 1, 2, 3, 4], vec![3, 2, 4, 0]] {
        let mut caches: Vec<KvCache<CpuBackend>> = order
            .iter()
            .map(|&i| primed(model, &cases[i].prefix))
            .collect();
        let mut seqs: Vec<SeqForward<CpuBackend>> = caches
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

#[test]
fn a_batched_forward_gives_every_sequence_its_own_forwards_bits() {
    let smollm2 = smollm2();
    let reference = json(&fixtures().join("gguf_ref/smollm2-135m-q4_1.json"));
    let tokens = ids(&reference["token_ids"]);
    let mut model = load_model(&smollm2);
    assert_batched_equals_alone(&mut model, &tokens, "smollm2 8-bit");
    let mut model = load_model_on(&smollm2, f32_backend());
    assert_batched_equals_alone(&mut model, &tokens, "smollm2 f32");
    for name in ["llama-f32", "qwen3-moe-f16", "gemma3-f16", "qwen3-next-f16"] {
        let dir = hf_bundle(name);
        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        let be: Arc<CpuBackend> = backend();
        let mut model = load_model_on(&dir, be);
        assert_batched_equals_alone(&mut model, &tokens, name);
    }
}

/// Requests decoded together in batched steps — greedy and sampled, one reporting log-probabilities, one
/// joining after five steps, one cancelled after three tokens, one copying its prompt — each get bitwise the
/// tokens, log-probabilities and final cache that `generate` gives them alone on the engine's own
/// (speculative) route, whether the batched steps run AR, draft by copying or with an MTP head per request.
#[test]
fn requests_decoded_together_get_their_solo_answers() {
    let path = smollm2();
    let mut solo = Engine::load(&path, backend(), &SpecMode::Auto).unwrap();
    let questions = [
        "Name three colors of the rainbow.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
        // Joins after five steps with a prompt of several prefill chunks, prefilled beside the others' tokens.
        "List four animals that live in the ocean. The ocean covers most of the planet, holds most of its water \
         and most of its living space, from sunlit reefs and kelp forests near the coasts to the open blue water \
         far from land, the cold polar seas under their ice, and the dark deep plains and trenches where the \
         pressure is enormous and no light ever reaches. Animals live in all of these places, and many of them \
         travel between them over a day, a season or a lifetime. Some are tiny and drift with the currents, \
         some are fast swimmers that cross whole oceans, and some never move from the rock they settled on. \
         Please keep the answer short.",
        "Say hello in French.",
        "Repeat this sentence word for word: the quick brown fox jumps over the lazy dog by the river bank.",
    ];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| solo.chat_prompt(&[Message::new("user", q)]).unwrap())
        .collect();
    let requests = [
        GenerateRequest::greedy(24),
        sampled(20, 0.8, 7),
        GenerateRequest {
            want_logprob: true,
            logprobs: 2,
            ..GenerateRequest::greedy(16)
        },
        sampled(28, 1.0, 3),
        GenerateRequest::greedy(12),
        GenerateRequest::greedy(24),
    ];
    // The long prompt stores a checkpoint inside its last chunk, as a chat prompt does before the answer.
    let mut requests = requests;
    requests[3].store_prefix = Some(prompts[3].len() - 7);
    assert!(
        prompts[3].len() > 2 * verity::backend::PREFILL_ROWS,
        "{}",
        prompts[3].len()
    );
    // Request 4 is cancelled after its third token.
    let cancel_after = |i: usize, n: usize| i == 4 && n == 3;
    let mut alone = Vec::new();
    for (i, (p, r)) in prompts.iter().zip(&requests).enumerate() {
        let mut sess = solo.new_session();
        let mut got = Vec::new();
        let stats = solo
            .generate(&mut sess, p, r, |_, t| {
                got.push((t.id, t.logprobs.clone().map(|l| format!("{l:?}"))));
                !cancel_after(i, got.len())
            })
            .unwrap();
        let cache = sess
            .cache
            .checkpoint(solo.model.backend())
            .layers()
            .to_vec();
        alone.push((got, stats.stop, cache));
    }

    // Batched steps on AR, on the copy route with batched drafts (each request drafting from its own context),
    // and on the MTP route and `auto` over the same weights with the head, each request drafting with a head
    // cache of its own (the head's weights shared) conditioned on its own rows' states from the batched forward.
    let mtp = smollm2_mtp();
    for (bundle, mode) in [
        (&path, SpecMode::Off),
        (&path, SpecMode::Auto),
        (&mtp, SpecMode::Mtp),
        (&mtp, SpecMode::Auto),
    ] {
        let mut together = Engine::load(bundle, backend(), &mode).unwrap();
        together.set_batch_drafts(true);
        let mut got: Vec<Vec<(u32, Option<String>)>> = vec![Vec::new(); requests.len()];
        let mut batch: Vec<Decoding<CpuBackend>> = Vec::new();
        let mut order = Vec::new();
        // With the head, every cycle drafts 3 tokens (a width the controller would pick from timings).
        let head = bundle == &mtp;
        let start = |e: &mut Engine<CpuBackend>, i: usize| {
            let sess = e.new_session();
            let draft_width = head.then_some(3);
            let r = GenerateRequest {
                draft_width,
                ..requests[i].clone()
            };
            e.start_decoding(sess, &prompts[i], r).unwrap()
        };
        for i in [0, 1, 2, 4, 5] {
            batch.push(start(&mut together, i));
            order.push(i);
        }
        let mut steps = 0;
        while batch.iter().any(|d| !d.is_finished()) {
            if steps == 5 {
                batch.push(start(&mut together, 3));
                order.push(3);
            }
            together
                .decode_step(&mut batch, |j, _, t| {
                    let i = order[j];
                    got[i].push((t.id, t.logprobs.clone().map(|l| format!("{l:?}"))));
                    !cancel_after(i, got[i].len())
                })
                .unwrap();
            steps += 1;
        }
        let (mut drafted, mut accepted, mut emitted) = (0, 0, 0);
        for (j, d) in batch.into_iter().enumerate() {
            let i = order[j];
            let (sess, stats) = d.into_parts();
            drafted += stats.drafted;
            accepted += stats.accepted;
            emitted += stats.completion_tokens;
            // The requests that draft do so with the route's own proposer (the head, where the route has one).
            let route = match (&mode, head) {
                (SpecMode::Off, _) => "ar",
                (_, true) => "mtp",
                (_, false) => "copy",
            };
            if requests[i].constraint.is_none() {
                assert_eq!(stats.route, route, "request {i}");
            }
            assert_eq!(
                got[i], alone[i].0,
                "request {i}: tokens differ from its solo run"
            );
            assert_eq!(stats.stop, alone[i].1, "request {i}: stop reason");
            let cache = sess
                .cache
                .checkpoint(together.model.backend())
                .layers()
                .to_vec();
            assert!(
                cache == alone[i].2,
                "request {i}: cache differs from its solo run's"
            );
        }
        if mode != SpecMode::Off {
            assert!(
                drafted > 0 && accepted > 0,
                "{mode:?}: drafted {drafted}, accepted {accepted}"
            );
        }
        if head {
            // Each head drafts from its own request's states, cycle after cycle.
            assert!(
                3 * accepted >= emitted,
                "{mode:?}: {accepted} of {emitted} tokens were accepted drafts"
            );
        }
    }
    assert_eq!(alone[4].1, StopReason::Cancelled);
}

/// A request that moves between decoding alone and batched steps (stopped alone at its seventh token, resumed in
/// batched steps beside another request, then continued alone again; what the server does as requests come and
/// go) emits bitwise its uninterrupted answer, greedy and sampled, on the MTP route, whose head drafts alone
/// and, with batched drafts on, in the batched steps too (a head cache of the request's own).
#[test]
fn a_request_moving_between_alone_and_batched_steps_keeps_its_tokens() {
    let mut e = Engine::load(&smollm2_mtp(), backend(), &SpecMode::Mtp).unwrap();
    let prompt = e
        .chat_prompt(&[Message::new(
            "user",
            "Write a short poem about autumn leaves.",
        )])
        .unwrap();
    let other = e
        .chat_prompt(&[Message::new("user", "Count from one to ten.")])
        .unwrap();
    let requests = [
        no_eos(40),
        GenerateRequest {
            ignore_eos: true,
            ..sampled(40, 0.8, 9)
        },
    ];
    for (batch_drafts, req) in [false, true]
        .into_iter()
        .flat_map(|b| requests.iter().map(move |r| (b, r)))
    {
        e.set_batch_drafts(batch_drafts);
        let req = req.clone();
        let mut sess = e.new_session();
        let mut want = Vec::new();
        e.generate(&mut sess, &prompt, &req, |_, t| {
            want.push(t.id);
            true
        })
        .unwrap();
        e.end_session(sess);

        let mut got = Vec::new();
        let mut sess = e.new_session();
        let alone = e
            .generate(&mut sess, &prompt, &req, |_, t| {
                got.push(t.id);
                got.len() < 7
            })
            .unwrap();
        assert_eq!(alone.stop, StopReason::Cancelled);
        let context: Vec<u32> = prompt.iter().chain(&got).copied().collect();
        let rest = GenerateRequest {
            max_tokens: req.max_tokens - got.len(),
            ..req.clone()
        };
        let resumed = e.resume_decoding(sess, &context, rest, alone).unwrap();
        let beside = e.new_session();
        let beside = e.start_decoding(beside, &other, no_eos(30)).unwrap();
        let mut batch = vec![resumed, beside];
        for _ in 0..10 {
            e.decode_step(&mut batch, |i, _, t| {
                if i == 0 {
                    got.push(t.id);
                }
                true
            })
            .unwrap();
        }
        let d = batch.remove(0);
        let (_, stats) = e
            .continue_alone(d, |_, t| {
                got.push(t.id);
                true
            })
            .unwrap();
        assert_eq!(
            got, want,
            "T {}, batched drafts {batch_drafts}",
            req.sampling.temperature
        );
        assert_eq!(stats.completion_tokens, want.len());
        assert_eq!(stats.stop, StopReason::MaxTokens);
        assert!(stats.drafted > 0, "the head drafted");
    }
}
