//! Block drafters: the route a bundle with `drafter/` resolves to (complete drafters, malformed ones), the
//! drafter's context alignment with the target's committed positions under any accept pattern, and drafter
//! output equal to AR — greedy byte for byte, sampled token for token with the same seed — on the tiny model and
//! on SmolLM2, alone and in batched steps.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::batched::assert_batched_block_drafts_equal_alone;
use common::*;
use verity::backend::cpu::CpuBackend;
use verity::bundle::{Bundle, DrafterStatus};
use verity::chat::Message;
use verity::engine::{Decoding, Engine, GenerateRequest};
use verity::model::{Batch, BlockDrafter, LogitRows, Model, TargetFeatures};
use verity::sample::SamplerConfig;
use verity::speculative::drafter::DrafterProposer;
use verity::speculative::{Outcome, Proposer, SpecMode};

fn be() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(1).unwrap())
}

fn route(dir: &Path, mode: &SpecMode) -> verity::Result<String> {
    Engine::load(dir, be(), mode).map(|e| e.plan.route.name().to_string())
}

#[test]
fn a_complete_drafter_is_the_auto_route() {
    let d = tiny_with_drafter("drafter-complete", 1);
    let b = Bundle::open(&d).unwrap();
    let DrafterStatus::Complete(spec) = &b.drafter else {
        panic!("{}", b.drafter.describe())
    };
    assert_eq!(
        (
            spec.target_layers.as_slice(),
            spec.block,
            spec.mask_token,
            spec.qk_norm
        ),
        (&[0, 1][..], 6, 5, true)
    );
    assert_eq!(route(&d, &SpecMode::Auto).unwrap(), "drafter");
    assert_eq!(route(&d, &SpecMode::Drafter).unwrap(), "drafter");
    // Without the folder, the explicit route says why it cannot run.
    let plain = copy_bundle("llama-f32", "drafter-none");
    let e = route(&plain, &SpecMode::Drafter).unwrap_err().to_string();
    assert!(e.contains("needs a complete block drafter"), "{e}");
    assert_eq!(route(&plain, &SpecMode::Auto).unwrap(), "copy");
}

#[test]
fn malformed_drafters_are_incomplete_and_auto_takes_the_next_route() {
    let s = tiny_drafter_shape();
    let good = random_drafter(&s, 2);
    let without =
        |name: &str| -> Vec<StEntry> { good.iter().filter(|t| t.0 != name).cloned().collect() };
    let reshaped = |name: &str| -> Vec<StEntry> {
        good.iter()
            .map(|t| {
                if t.0 == name {
                    let n = t.3.len() / 4;
                    (t.0.clone(), "F32", vec![n], t.3.clone())
                } else {
                    t.clone()
                }
            })
            .collect()
    };
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut c = drafter_config(&s);
        edit(&mut c);
        c
    };
    let cases: Vec<(&str, serde_json::Value, Vec<StEntry>, &str)> = vec![
        (
            "no fc",
            drafter_config(&s),
            without("fc.weight"),
            "fc.weight",
        ),
        (
            "no k norm",
            drafter_config(&s),
            without("layers.0.self_attn.k_norm.weight"),
            "k_norm",
        ),
        (
            "flat q",
            drafter_config(&s),
            reshaped("layers.0.self_attn.q_proj.weight"),
            "q_proj",
        ),
        (
            "layer outside the target",
            with(&|c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 2])),
            good.clone(),
            "target layers",
        ),
        (
            "repeated layer",
            with(&|c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 1])),
            good.clone(),
            "target layers",
        ),
        (
            "mask outside the vocabulary",
            with(&|c| c["dflash_config"]["mask_token_id"] = serde_json::json!(320)),
            good.clone(),
            "mask token",
        ),
        (
            "another hidden size",
            with(&|c| c["hidden_size"] = serde_json::json!(32)),
            good.clone(),
            "hidden size",
        ),
        (
            "block of one",
            with(&|c| c["dflash_config"]["block_size"] = serde_json::json!(1)),
            good.clone(),
            "block size",
        ),
        (
            "scaled embedding",
            with(&|c| c["dflash_config"]["input_embedding_scale"] = serde_json::json!(2.0)),
            good.clone(),
            "input_embedding_scale",
        ),
        (
            "causal layers",
            with(&|c| c["is_causal"] = serde_json::json!(true)),
            good.clone(),
            "causal",
        ),
        (
            "draft vocabulary outside the vocabulary",
            drafter_config(&s),
            [good.clone(), vec![draft_vocab(&[1, 2, 320])]].concat(),
            "outside the vocabulary",
        ),
        (
            "draft vocabulary of floats",
            drafter_config(&s),
            [
                good.clone(),
                vec![("draft_vocab".into(), "F32", vec![2], vec![0; 8])],
            ]
            .concat(),
            "I32",
        ),
        (
            "no target layers",
            with(&|c| {
                c["dflash_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("target_layer_ids");
            }),
            good.clone(),
            "target_layer_ids",
        ),
    ];
    for (what, cfg, ts, reason) in cases {
        let d = copy_bundle("llama-f32", "drafter-bad");
        write_drafter(&d, &cfg, &ts);
        let b = Bundle::open(&d).unwrap();
        match &b.drafter {
            DrafterStatus::Incomplete(r) => assert!(r.contains(reason), "{what}: {r}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(route(&d, &SpecMode::Auto).unwrap(), "copy", "{what}");
        let e = route(&d, &SpecMode::Drafter).unwrap_err().to_string();
        assert!(e.contains(reason), "{what}: {e}");
    }
    // A config that is not JSON, and a truncated weights file.
    let d = copy_bundle("llama-f32", "drafter-bad-files");
    write_drafter(&d, &drafter_config(&s), &good);
    std::fs::write(d.join("drafter/config.json"), "{ not json").unwrap();
    assert!(
        matches!(Bundle::open(&d).unwrap().drafter, DrafterStatus::Incomplete(r) if r.contains("invalid drafter config"))
    );
    write_drafter(&d, &drafter_config(&s), &good);
    let w = d.join("drafter/model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
    let b = Bundle::open(&d).expect("a broken drafter never makes the bundle unreadable");
    assert!(
        matches!(b.drafter, DrafterStatus::Incomplete(_)),
        "{:?}",
        b.drafter
    );
}

/// The target's states at the drafter's layers for `tokens` (positions 0..), computed in one forward.
fn target_states(model: &mut Model<CpuBackend>, tokens: &[u32], layers: &[usize]) -> Vec<f32> {
    let mut cache = model.new_cache(256);
    model
        .forward_features(
            &mut cache,
            &Batch::causal(tokens, 0),
            LogitRows::None,
            &TargetFeatures::layers(layers.to_vec()),
        )
        .unwrap()
        .features
}

/// A forward asked for layer states and the final state together reports, row by row, the layers' states then
/// the final one: bitwise what forwards asked for each alone report (what a drafter and an MTP head side by side
/// are fed).
#[test]
fn layer_and_final_states_together_are_each_alone_row_by_row() {
    let d = tiny_with_drafter("features-union", 3);
    let mut model = Model::load(&Bundle::open(&d).unwrap(), be()).unwrap();
    let tokens = [5, 17, 3, 99, 42];
    let run = |model: &mut Model<CpuBackend>, f: TargetFeatures| {
        let mut cache = model.new_cache(64);
        model
            .forward_features(&mut cache, &Batch::causal(&tokens, 0), LogitRows::All, &f)
            .unwrap()
    };
    let both = TargetFeatures::layers(vec![1, 0]).union(&TargetFeatures::final_state());
    let all = run(&mut model, both.clone());
    let layers = run(&mut model, TargetFeatures::layers(vec![1, 0])).features;
    let last = run(&mut model, TargetFeatures::final_state()).features;
    let h = model.hp.hidden;
    assert_eq!(all.features.len(), tokens.len() * 3 * h);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for r in 0..tokens.len() {
        let row = &all.features[r * 3 * h..(r + 1) * 3 * h];
        assert_eq!(
            bits(&row[..2 * h]),
            bits(&layers[r * 2 * h..(r + 1) * 2 * h]),
            "row {r}"
        );
        assert_eq!(
            bits(&row[2 * h..]),
            bits(&last[r * h..(r + 1) * h]),
            "row {r}"
        );
    }
    assert_eq!(
        both.extract(&TargetFeatures::final_state(), &all.features, h),
        last
    );
    assert_eq!(
        both.extract(&TargetFeatures::layers(vec![1, 0]), &all.features, h),
        layers
    );
}

/// Whatever the verifier keeps, the drafter's context stays the committed positions': every cycle's drafts
/// equal those of a fresh drafter given the whole context at once.
#[test]
fn the_drafters_context_stays_aligned_under_any_accept_pattern() {
    context_stays_aligned(&tiny_with_drafter("drafter-align", 3), 1);
    // Drafting from a draft vocabulary (every third id): drafts come from it.
    context_stays_aligned(&tiny_with_vocab_drafter("drafter-align-vocab", 4), 3);
}

/// [`the_drafters_context_stays_aligned_under_any_accept_pattern`] for the drafter of bundle `d`, whose draft
/// vocabulary holds the multiples of `step`.
fn context_stays_aligned(d: &Path, step: u32) {
    let bundle = Bundle::open(d).unwrap();
    let mut model = Model::load(&bundle, be()).unwrap();
    let layers = vec![0, 1];
    let features = TargetFeatures::layers(layers.clone());
    let w = features.width(64);
    let new_proposer = |m: &Model<CpuBackend>| {
        let mut p =
            DrafterProposer::new(BlockDrafter::load(&bundle, m).unwrap(), 320, 256).unwrap();
        p.reset(&SamplerConfig::greedy());
        p
    };
    let mut inc = new_proposer(&model);
    assert_eq!(inc.features(), features);
    let rnd = random_f32(400, 9, 1.0);
    let mut r = rnd.iter().map(|x| (x.abs() * 1e6) as usize);
    let mut context: Vec<u32> = (0..9).map(|_| (r.next().unwrap() % 320) as u32).collect();
    let mut cache = model.new_cache(256);
    let n0 = context.len() - 1;
    let out = model
        .forward_features(
            &mut cache,
            &Batch::causal(&context[..n0], 0),
            LogitRows::None,
            &features,
        )
        .unwrap();
    inc.observe_hidden(0, &out.features);
    let mut drafted = 0;
    for cycle in 0..25 {
        let n = context.len() - 1;
        let k = 1 + r.next().unwrap() % 5;
        let draft = inc.propose(&context, k).unwrap();
        assert_eq!(draft.len(), k, "cycle {cycle}");
        assert!(draft.tokens().iter().all(|t| t % step == 0), "{draft:?}");
        drafted += k;

        let mut fresh = new_proposer(&model);
        fresh.observe_hidden(0, &target_states(&mut model, &context[..n], &layers));
        assert_eq!(
            draft,
            fresh.propose(&context, k).unwrap(),
            "cycle {cycle}: drafts differ from a fresh drafter's"
        );

        // Verify on the target, keep a random prefix, add a random bonus token.
        let mut rows = vec![context[n]];
        rows.extend(draft.tokens());
        let out = model
            .forward_features(
                &mut cache,
                &Batch::causal(&rows, n),
                LogitRows::All,
                &features,
            )
            .unwrap();
        let a = r.next().unwrap() % (k + 1);
        cache.truncate(n + 1 + a);
        inc.observe(&Outcome::of(&draft, &(0..a).collect::<Vec<_>>()));
        inc.observe_hidden(n, &out.features[..(1 + a) * w]);
        context.extend(&draft.tokens()[..a]);
        context.push((r.next().unwrap() % 320) as u32);
    }
    assert!(drafted > 25);
    // A context that leaves the drafter's (another conversation) rolls it back to what they share.
    let mut other = context[..12].to_vec();
    other.extend([7, 8, 9]);
    let n = other.len() - 1;
    inc.observe_hidden(0, &target_states(&mut model, &other[..n], &layers));
    let mut fresh = new_proposer(&model);
    fresh.observe_hidden(0, &target_states(&mut model, &other[..n], &layers));
    assert_eq!(
        inc.propose(&other, 4).unwrap(),
        fresh.propose(&other, 4).unwrap()
    );
}

#[test]
fn drafter_output_equals_ar_on_the_tiny_model() {
    for d in [
        tiny_with_drafter("drafter-greedy", 5),
        tiny_with_vocab_drafter("drafter-vocab", 6),
    ] {
        drafter_output_equals_ar(&d);
    }
}

fn drafter_output_equals_ar(d: &Path) {
    let mut ar = Engine::load(d, be(), &SpecMode::Off).unwrap();
    let mut drafter = Engine::load(d, be(), &SpecMode::Drafter).unwrap();
    let rnd = random_f32(64, 11, 1.0);
    for p in 0..4 {
        let prompt: Vec<u32> = rnd[p * 12..p * 12 + 12]
            .iter()
            .map(|x| ((x.abs() * 1e6) as u32) % 320)
            .collect();
        for sampling in [
            SamplerConfig::greedy(),
            SamplerConfig {
                temperature: 0.8,
                seed: 7 + p as u64,
                ..SamplerConfig::greedy()
            },
        ] {
            let req = GenerateRequest {
                ignore_eos: true,
                draft_width: Some(1 + p),
                sampling,
                ..GenerateRequest::greedy(48)
            };
            let (want, ..) = answer(&mut ar, &prompt, &req);
            let (got, _, stats) = answer(&mut drafter, &prompt, &req);
            let drafted = stats.drafted;
            assert_eq!(want, got, "prompt {p}, {sampling:?}");
            assert!(drafted > 0, "prompt {p}: nothing drafted");
        }
    }
}

#[test]
fn drafter_output_equals_ar_on_smollm2() {
    auto_equals_ar_on_smollm2(
        &smollm2_with_drafter(),
        "drafter",
        &[
            "Write a haiku about the sea.",
            "Write a Python function that reverses a string.",
            "List the planets of the solar system.",
        ],
    );
}

/// `auto` on a bundle with both a block drafter and an MTP head runs them side by side (the chooser lets the
/// one that yields more tokens per second draft, each fed its own target states): its output is AR's, greedy
/// and sampled.
#[test]
fn auto_with_a_drafter_and_an_mtp_head_equals_ar_on_smollm2() {
    auto_equals_ar_on_smollm2(
        &smollm2_with_drafter_and_mtp(),
        "drafter+mtp",
        &[
            "Write a Python function that reverses a string.",
            "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
        ],
    );
}

/// `auto` on bundle `d` takes `route` and answers each of `texts` as AR does, greedy and sampled, drafting —
/// alone, and all together in batched steps, each request drafting with proposers of its own over the shared
/// drafter (and head).
fn auto_equals_ar_on_smollm2(d: &Path, route: &str, texts: &[&str]) {
    let b = backend();
    let mut ar = Engine::load(d, b.clone(), &SpecMode::Off).unwrap();
    let mut spec = Engine::load(d, b, &SpecMode::Auto).unwrap();
    assert_eq!(spec.plan.route.name(), route, "{}", spec.plan.reason);
    let mut cases = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let prompt = ar.chat_prompt(&[Message::new("user", text)]).unwrap();
        for sampling in [
            SamplerConfig::greedy(),
            SamplerConfig {
                temperature: 0.7,
                seed: 3,
                ..SamplerConfig::greedy()
            },
        ] {
            let req = GenerateRequest {
                ignore_eos: true,
                draft_width: Some(3 + i),
                sampling,
                ..GenerateRequest::greedy(96)
            };
            let (want, ..) = answer(&mut ar, &prompt, &req);
            let (got, _, stats) = answer(&mut spec, &prompt, &req);
            assert_eq!(stats.route, route);
            assert_eq!(want, got, "{text}: {sampling:?}");
            assert!(stats.drafted > 0, "{text}: nothing drafted");
            cases.push((prompt.clone(), req, want));
        }
    }
    spec.set_batch_drafts(true);
    let mut batch: Vec<Decoding<CpuBackend>> = cases
        .iter()
        .map(|(prompt, req, _)| {
            let sess = spec.new_session();
            spec.start_decoding(sess, prompt, req.clone()).unwrap()
        })
        .collect();
    let mut got = vec![Vec::new(); cases.len()];
    while batch.iter().any(|d| !d.is_finished()) {
        spec.decode_step(&mut batch, |i, _, t| {
            got[i].push(t.id);
            true
        })
        .unwrap();
    }
    for (i, (d, (_, req, want))) in batch.into_iter().zip(&cases).enumerate() {
        let (_, stats) = d.into_parts();
        assert_eq!(&got[i], want, "batched request {i}: {:?}", req.sampling);
        assert_eq!(stats.route, route);
        assert!(stats.drafted > 0, "batched request {i}: nothing drafted");
    }
}

/// The drafter's forward against an independent one (`scripts/fixtures/make_drafter_reference.py`, float64
/// numpy, as published DFlash drafters define it): the tiny fixture's target, a two-layer drafter, context states
/// given directly. The drafter's weights run re-encoded as Q8_0, so logits agree to quantization error and every
/// row's argmax agrees (the reference's top-two margins are at least 0.14).
/// Several requests' block drafts in one batched call (one forward over every request's block, each block's
/// attention over its own request's context) give each request bitwise the logits and context cache of its
/// own draft, with and without a draft vocabulary.
#[test]
fn batched_block_drafts_give_every_request_its_own_drafts_bits() {
    let tokens: Vec<u32> = (0..80u32).map(|i| (i * 37 + 5) % 320).collect();
    for d in [
        tiny_with_drafter("drafter-batched", 3),
        tiny_with_vocab_drafter("drafter-batched-vocab", 4),
    ] {
        let bundle = Bundle::open(&d).unwrap();
        let mut model = Model::load(&bundle, be()).unwrap();
        let mut drafter = BlockDrafter::load(&bundle, &model).unwrap();
        let label = d.display().to_string();
        assert_batched_block_drafts_equal_alone(&mut model, &mut drafter, &tokens, &label);
    }
}

#[test]
fn the_drafters_forward_matches_an_independent_reference() {
    let d = copy_bundle("llama-f32", "drafter-reference");
    std::fs::create_dir_all(d.join("drafter")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(
            fixtures().join("drafter").join(f),
            d.join("drafter").join(f),
        )
        .unwrap();
    }
    let reference = json(&fixtures().join("drafter/reference.json"));
    let states: Vec<f32> = reference["context_states"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let ctx = reference["context_len"].as_u64().unwrap() as usize;
    let pending = reference["pending"].as_u64().unwrap() as u32;
    let want: Vec<Vec<f64>> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        })
        .collect();

    let bundle = Bundle::open(&d).unwrap();
    let model = Model::load(&bundle, f32_backend()).unwrap();
    let mut drafter = BlockDrafter::load(&bundle, &model).unwrap();
    let mut cache = drafter.new_cache(64);
    // The context in two pieces, as cycles add it.
    let w = drafter.state_width();
    drafter
        .extend_context(&mut cache, 0, &states[..4 * w])
        .unwrap();
    drafter
        .extend_context(&mut cache, 4, &states[4 * w..])
        .unwrap();
    assert_eq!(cache.len(), ctx);
    let k = want.len();
    let logits = drafter.draft(&mut cache, pending, ctx, k).unwrap();
    assert_eq!(
        cache.len(),
        ctx,
        "a draft leaves the committed context as it was"
    );
    let mut worst = 0f64;
    for (i, row) in want.iter().enumerate() {
        let got = &logits[i * 320..(i + 1) * 320];
        for (g, w) in got.iter().zip(row) {
            worst = worst.max((*g as f64 - w).abs());
        }
        assert_eq!(
            verity::sample::argmax(got) as u64,
            reference["argmax"][i].as_u64().unwrap(),
            "row {i}"
        );
    }
    // Measured: 0.09 (logits span ±7).
    assert!(worst < 0.2, "largest logit difference {worst}");
    // The block's K/V were never kept: drafting again from the same context gives the same logits.
    assert_eq!(drafter.draft(&mut cache, pending, ctx, k).unwrap(), logits);
}
