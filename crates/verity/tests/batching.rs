//! Several sequences in one forward (what continuous batching runs): every sequence's logits, argmaxes, target
//! states (its proposer's features) and cache are bitwise what its own forward gives — a prefill, a verify, a draft tree, a chunk whose last row
//! alone has logits and a step without any side by side, on the 8-bit and f32 paths, a mixture of experts,
//! local attention layers and a hybrid with recurrent layers.

mod common;

use std::sync::Arc;

use common::batched::assert_batched_equals_alone;
use common::*;
use verity::backend::cpu::CpuBackend;
use verity::chat::Message;
use verity::engine::{Decoding, Engine, GenerateRequest, StopReason};
use verity::speculative::SpecMode;

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
