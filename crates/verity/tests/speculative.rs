//! Speculative decoding is lossless: greedy and seeded sampled output and caches equal AR's on every route and
//! under adversarial proposers; sampled AR output has the processed distribution, so every route's has too.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::adversary::{scripted, Adversary};
use common::*;
use proptest::prelude::*;
use verity::backend::cpu::CpuBackend;
use verity::bundle::Bundle;
use verity::chat::Message;
use verity::engine::{Engine, GenerateRequest, GenerationStats};
use verity::model::{Model, MtpHead};
use verity::sample::SamplerConfig;
use verity::speculative::draft_model::DraftModel;
use verity::speculative::mtp::MtpProposer;
use verity::speculative::{Proposer, SpecMode};

struct Run {
    tokens: Vec<u32>,
    cache: Vec<(Vec<f32>, Vec<f32>)>,
    /// The recurrent layers' states, where the model has such layers.
    states: Vec<Vec<f32>>,
    stats: GenerationStats,
}

/// Generate up to `max` tokens (stopping after `stop_after` if given) and snapshot the session cache.
fn run(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    req: &GenerateRequest,
    stop_after: Option<usize>,
) -> Run {
    let mut sess = e.new_session();
    let mut tokens = Vec::new();
    let stats = e
        .generate(&mut sess, prompt, req, |_, emitted| {
            let t = emitted.id;
            tokens.push(t);
            stop_after != Some(tokens.len())
        })
        .unwrap();
    let ckpt = sess.cache.checkpoint(e.model.backend());
    Run {
        tokens,
        cache: ckpt.layers().to_vec(),
        states: ckpt.recurrent().map(<[_]>::to_vec).unwrap_or_default(),
        stats,
    }
}

fn assert_same(ar: &Run, other: &Run, label: &str) {
    assert_eq!(ar.tokens, other.tokens, "{label}: tokens differ from AR");
    assert!(
        ar.cache.len() == other.cache.len()
            && ar
                .cache
                .iter()
                .zip(&other.cache)
                .all(|((ka, va), (kb, vb))| {
                    ka.len() == kb.len()
                        && ka.iter().zip(kb).all(|(a, b)| a.to_bits() == b.to_bits())
                        && va.iter().zip(vb).all(|(a, b)| a.to_bits() == b.to_bits())
                }),
        "{label}: cache differs from AR's"
    );
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|s| s.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert!(
        bits(&ar.states) == bits(&other.states),
        "{label}: recurrent states differ from AR's"
    );
}

/// AR's run of `req` on `prompt`, then one run per proposer of `kinds` drafting from AR's own output (so that
/// right, wrong and partly right drafts all occur), each asserted equal to AR's; returns those runs.
fn against_adversaries(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    req: &GenerateRequest,
    kinds: &[Adversary],
    label: &str,
) -> Vec<(Adversary, Run)> {
    let vocab = e.model.hp.vocab;
    e.set_proposer(None);
    let base = run(e, prompt, req, None);
    let oracle: Vec<u32> = prompt.iter().chain(&base.tokens).copied().collect();
    kinds
        .iter()
        .map(|kind| {
            e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
            let r = run(e, prompt, req, None);
            assert_same(&base, &r, &format!("{label} {kind:?}"));
            (kind.clone(), r)
        })
        .collect()
}

fn prompts(e: &Engine<CpuBackend>) -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(fixtures().join("prompts/spec_prompts.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let messages: Vec<Message> = serde_json::from_value(v["messages"].clone()).unwrap();
            (
                v["id"].as_str().unwrap().to_string(),
                e.chat_prompt(&messages).unwrap(),
            )
        })
        .collect()
}

#[test]
fn every_route_reproduces_ar_greedy_output_on_smollm2_over_256_tokens() {
    let path = smollm2();
    let be = backend();
    let mut ar = Engine::load(&path, be.clone(), &SpecMode::Off).unwrap();
    let mut routes = [
        (
            "copy",
            Engine::load(&path, be.clone(), &SpecMode::Copy).unwrap(),
        ),
        (
            "draft-model (self)",
            Engine::load(&path, be.clone(), &SpecMode::DraftModel(Some(path.clone()))).unwrap(),
        ),
        (
            "auto",
            Engine::load(&path, be.clone(), &SpecMode::Auto).unwrap(),
        ),
        (
            "mtp (trained head)",
            Engine::load(&smollm2_mtp(), be.clone(), &SpecMode::Mtp).unwrap(),
        ),
    ];
    let req = no_eos(256);
    for (id, prompt) in prompts(&ar) {
        let base = run(&mut ar, &prompt, &req, None);
        assert_eq!(base.tokens.len(), 256);
        for (name, e) in routes.iter_mut() {
            let r = run(e, &prompt, &req, None);
            assert_same(&base, &r, &format!("{id} / {name}"));
            if *name == "draft-model (self)" {
                assert_eq!(
                    r.stats.accepted, r.stats.drafted,
                    "{id}: a model drafting for itself is always right"
                );
            }
        }
    }
}

#[test]
fn adversarial_proposers_never_change_smollm2_greedy_output_or_cache() {
    let path = smollm2();
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let prompt = e
        .chat_prompt(&[Message::new("user", "Explain what a prime number is.")])
        .unwrap();
    let kinds = [
        Adversary::AlwaysRight,
        Adversary::AlwaysWrong,
        Adversary::RightThenWrong(3),
        Adversary::Random(5),
        Adversary::Tree(5),
        Adversary::Tree(6),
    ];
    for (kind, r) in against_adversaries(&mut e, &prompt, &no_eos(64), &kinds, "smollm2") {
        if let Adversary::AlwaysRight = kind {
            // How wide the controller drafts depends on this machine's measured verify costs; that every draft
            // is kept and cycles carry several tokens each does not.
            assert_eq!(r.stats.accepted, r.stats.drafted, "always right");
            assert!(
                r.stats.cycles < 64 / 2,
                "an always-right proposer needs few cycles ({})",
                r.stats.cycles
            );
        }
    }
}

/// Gemma 3 270M, whose local layers see a 512-token window and keep a ring of 768 slots: from a 720-token
/// prompt, 96 tokens run past the ring's first wrap. The copy route and adversarial proposers (rejected drafts
/// rolled back, trees whose kept path moves down, both across the wrap) leave AR's greedy tokens and cache
/// unchanged.
#[test]
fn copying_and_adversaries_reproduce_gemma3_ar_output_across_its_sliding_window() {
    let path = gemma3_270m();
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    assert_eq!(e.model.hp.layer_attention(0).0, Some(512));
    let vocab = e.model.hp.vocab;
    let prompt = gemma3_prompt(&e.tokenizer, 720);
    let req = no_eos(96);
    e.set_proposer(None);
    let base = run(&mut e, &prompt, &req, None);
    let mut copy = Engine::load(&path, backend(), &SpecMode::Copy).unwrap();
    let r = run(&mut copy, &prompt, &req, None);
    assert_same(&base, &r, "copy");
    assert!(r.stats.accepted > 0, "copying found nothing to draft");
    let oracle: Vec<u32> = prompt.iter().chain(&base.tokens).copied().collect();
    for kind in [
        Adversary::AlwaysWrong,
        Adversary::RightThenWrong(2),
        Adversary::Random(9),
        Adversary::Tree(9),
    ] {
        e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
        let r = run(&mut e, &prompt, &req, None);
        assert_same(&base, &r, &format!("gemma3 {kind:?}"));
    }
}

/// The sampled twin of greedy exactness: with a seed, every route emits sampled AR's tokens and cache, byte for
/// byte — on its first request, and again after another request has changed its proposer's and controller's
/// state (other contexts, other widths).
#[test]
fn every_route_reproduces_sampled_ar_output_for_a_seed_on_smollm2() {
    let path = smollm2();
    let be = backend();
    let mut ar = Engine::load(&path, be.clone(), &SpecMode::Off).unwrap();
    let hot_drafter = {
        let mut e = Engine::load(&path, be.clone(), &SpecMode::Off).unwrap();
        let hot = SamplerConfig {
            temperature: 1.7,
            ..SamplerConfig::default()
        };
        let m = Model::load(&Bundle::open(&path).unwrap(), be.clone()).unwrap();
        let vocab = e.model.hp.vocab;
        e.set_proposer(Some(Box::new(
            DraftModel::new(m, vocab, Some(hot)).unwrap(),
        )));
        e
    };
    let mut routes = [
        (
            "copy",
            Engine::load(&path, be.clone(), &SpecMode::Copy).unwrap(),
        ),
        (
            "draft-model (self)",
            Engine::load(&path, be.clone(), &SpecMode::DraftModel(Some(path.clone()))).unwrap(),
        ),
        ("draft-model (self, hotter q)", hot_drafter),
        (
            "mtp (trained head)",
            Engine::load(&smollm2_mtp(), be.clone(), &SpecMode::Mtp).unwrap(),
        ),
    ];
    let all = prompts(&ar);
    let (edit, story) = (&all[2].1, &all[0].1);
    for (temperature, seed) in [(0.8, 1), (0.8, 42), (1.2, 7), (1.2, 2024)] {
        let req = sampled(32, temperature, seed);
        let base = run(&mut ar, edit, &req, None);
        for (name, e) in routes.iter_mut() {
            let label = format!("{name}, T {temperature}, seed {seed}");
            let first = run(e, edit, &req, None);
            assert_same(&base, &first, &label);
            run(e, story, &sampled(8, 1.0, seed + 1), None);
            let again = run(e, edit, &req, None);
            assert_same(&base, &again, &format!("{label}, after another request"));
            if name.ends_with("(self)") {
                assert_eq!(
                    first.stats.accepted, first.stats.drafted,
                    "{label}: a model sampling for itself with the same uniforms is always right"
                );
            }
        }
    }
}

/// Sampled: random widths and tokens, an oracle of sampled AR's output, or one right for a while → AR's tokens and
/// cache. The oracle is always kept: a draft is kept exactly when it is the target's draw at its position.
#[test]
fn adversarial_proposers_never_change_smollm2_sampled_output_or_cache() {
    let path = smollm2();
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let vocab = e.model.hp.vocab;
    let prompt = e
        .chat_prompt(&[Message::new("user", "Explain what a prime number is.")])
        .unwrap();
    for (temperature, seed) in [(0.8, 3), (1.2, 99)] {
        let req = sampled(48, temperature, seed);
        e.set_proposer(None);
        let base = run(&mut e, &prompt, &req, None);
        let oracle: Vec<u32> = prompt.iter().chain(&base.tokens).copied().collect();
        for kind in [
            Adversary::AlwaysRight,
            Adversary::RightThenWrong(3),
            Adversary::Random(seed),
            Adversary::Random(seed + 1),
            Adversary::Tree(seed),
        ] {
            e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
            let r = run(&mut e, &prompt, &req, None);
            assert_same(
                &base,
                &r,
                &format!("{kind:?}, T {temperature}, seed {seed}"),
            );
            if let Adversary::AlwaysRight = kind {
                assert_eq!(
                    r.stats.accepted, r.stats.drafted,
                    "the oracle is always kept"
                );
                assert!(r.stats.cycles < 48 / 2, "{} cycles", r.stats.cycles);
            }
        }
    }
}

/// A mixture of experts (Qwen3-MoE), and a hybrid of Gated DeltaNet and attention layers with a mixture and a
/// shared expert (Qwen3-Next), under every kind of proposer, greedy and sampled: verifies whose rows route to
/// different experts, rollbacks after wrong drafts (the recurrent state back to the last kept row), trees (each
/// node stepped from its parent's state); the tokens, the K/V and the recurrent states equal AR's.
#[test]
fn adversarial_proposers_never_change_mixture_or_linear_attention_output_or_state() {
    for name in ["qwen3-moe-f16", "qwen3-next-f16"] {
        let mut e = Engine::load(&hf_bundle(name), backend(), &SpecMode::Off).unwrap();
        let prompt: Vec<u32> = (3..40).collect();
        let kinds = [
            Adversary::AlwaysRight,
            Adversary::AlwaysWrong,
            Adversary::RightThenWrong(3),
            Adversary::Random(11),
            Adversary::Tree(12),
        ];
        for req in [no_eos(40), sampled(40, 0.8, 5)] {
            against_adversaries(&mut e, &prompt, &req, &kinds, name);
        }
    }
}

/// One tiny engine per test thread: loading is cheap, and proptest runs cases sequentially.
fn tiny() -> Engine<CpuBackend> {
    Engine::load(
        &hf_bundle("llama-f32"),
        Arc::new(CpuBackend::new(1).unwrap()),
        &SpecMode::Off,
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, .. ProptestConfig::default() })]

    /// On a small random model: any proposer, any stopping point → the tokens and the cache equal AR's.
    #[test]
    fn greedy_output_and_cache_equal_ar_under_any_proposer(
        prompt in proptest::collection::vec(3u32..320, 1..24),
        kind in prop_oneof![
            any::<u64>().prop_map(Adversary::Random),
            Just(Adversary::AlwaysRight),
            Just(Adversary::AlwaysWrong),
            (0usize..8).prop_map(Adversary::RightThenWrong),
            any::<u64>().prop_map(Adversary::Tree),
        ],
        stop_after in proptest::option::of(1usize..40),
        max_tokens in 1usize..40,
    ) {
        thread_local!(static ENGINE: Mutex<Option<Engine<CpuBackend>>> = const { Mutex::new(None) });
        ENGINE.with(|cell| {
            let mut guard = cell.lock().unwrap();
            let e = guard.get_or_insert_with(tiny);
            let vocab = e.model.hp.vocab;
            let req = no_eos(max_tokens);
            e.set_proposer(None);
            let base = run(e, &prompt, &req, stop_after);
            let full = run(e, &prompt, &no_eos(48), None);
            let oracle: Vec<u32> = prompt.iter().chain(&full.tokens).copied().collect();
            e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
            let r = run(e, &prompt, &req, stop_after);
            assert_same(&base, &r, &format!("{kind:?}"));
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, .. ProptestConfig::default() })]

    /// Sampled, on a small random model: any proposer, any seed and settings, any stopping point → the tokens and
    /// the cache equal sampled AR's.
    #[test]
    fn sampled_output_and_cache_equal_ar_under_any_proposer(
        prompt in proptest::collection::vec(3u32..320, 1..24),
        kind in prop_oneof![
            any::<u64>().prop_map(Adversary::Random),
            Just(Adversary::AlwaysRight),
            Just(Adversary::AlwaysWrong),
            (0usize..8).prop_map(Adversary::RightThenWrong),
            any::<u64>().prop_map(Adversary::Tree),
        ],
        seed in any::<u64>(),
        temperature in prop_oneof![Just(0.8f32), Just(1.2), Just(3.0)],
        top_p in prop_oneof![Just(1.0f32), Just(0.9)],
        repetition_penalty in prop_oneof![Just(1.0f32), Just(1.3)],
        stop_after in proptest::option::of(1usize..40),
        max_tokens in 1usize..40,
    ) {
        thread_local!(static ENGINE: Mutex<Option<Engine<CpuBackend>>> = const { Mutex::new(None) });
        ENGINE.with(|cell| {
            let mut guard = cell.lock().unwrap();
            let e = guard.get_or_insert_with(tiny);
            let vocab = e.model.hp.vocab;
            let sampling = SamplerConfig { temperature, top_p, repetition_penalty, seed, ..SamplerConfig::default() };
            let req = GenerateRequest { sampling, ..no_eos(max_tokens) };
            e.set_proposer(None);
            let base = run(e, &prompt, &req, stop_after);
            let full = run(e, &prompt, &GenerateRequest { sampling, ..no_eos(48) }, None);
            let oracle: Vec<u32> = prompt.iter().chain(&full.tokens).copied().collect();
            e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
            let r = run(e, &prompt, &req, stop_after);
            assert_same(&base, &r, &format!("{kind:?}"));
        });
    }
}

/// The exact distribution of the first two completion tokens under `cfg` (enumerating the first token).
fn exact_pairs(
    model: &mut Model<CpuBackend>,
    prompt: &[u32],
    cfg: SamplerConfig,
) -> Vec<((u32, u32), f64)> {
    use verity::model::{Batch, LogitRows};
    use verity::sample::Sampler;
    let s = Sampler::new(cfg).unwrap();
    let mut cache = model.new_cache(64);
    let out = model
        .forward(&mut cache, &Batch::causal(prompt, 0), LogitRows::Last, &[])
        .unwrap();
    let n = cache.len();
    let mut pairs = Vec::new();
    for (t1, p1) in s.distribution(&out.logits, prompt) {
        cache.truncate(n);
        let o2 = model
            .forward(&mut cache, &Batch::causal(&[t1], n), LogitRows::Last, &[])
            .unwrap();
        let mut hist = prompt.to_vec();
        hist.push(t1);
        for (t2, p2) in s.distribution(&o2.logits, &hist) {
            pairs.push(((t1, t2), p1 as f64 * p2 as f64));
        }
    }
    pairs
}

/// Pearson χ² goodness of fit of `samples` to `exact`, pooling cells whose expected count is under 5.
fn chi_square(exact: &[((u32, u32), f64)], samples: &[(u32, u32)]) -> (f64, usize) {
    let n = samples.len() as f64;
    let mut counts = std::collections::HashMap::new();
    for s in samples {
        *counts.entry(*s).or_insert(0usize) += 1;
    }
    let (mut chi, mut df, mut pool_e, mut pool_o) = (0.0, 0usize, 0.0, 0.0);
    for (cell, p) in exact {
        let e = p * n;
        let o = *counts.get(cell).unwrap_or(&0) as f64;
        if e < 5.0 {
            pool_e += e;
            pool_o += o;
        } else {
            chi += (o - e).powi(2) / e;
            df += 1;
        }
    }
    let known: std::collections::HashSet<_> = exact.iter().map(|c| c.0).collect();
    pool_o += samples.iter().filter(|s| !known.contains(s)).count() as f64;
    if pool_e > 0.0 {
        chi += (pool_o - pool_e).powi(2) / pool_e;
        df += 1;
    }
    (chi, df.saturating_sub(1))
}

/// χ² critical value at significance 1e-3 (Wilson–Hilferty approximation).
fn chi_critical(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090; // one-sided 0.999 normal quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Sampled speculation must give the AR sampler's distribution. For the first two completion tokens of a small
/// model (temperature 1, top-k 6: 36 cells), 3,000 seeded AR runs are tested against the exact joint
/// distribution with a χ² test at significance 1e-3, and every route must emit AR's tokens for each seed (so
/// the same χ²), whatever its drafter's distribution. The same test with the drafter's distribution used as if it
/// were the target's (a biased "route") fails by a wide margin, which shows the test has the power to see a
/// wrong sampler: with 3,000 samples a shift of total variation ~0.05 gives χ² far above the critical value.
#[test]
fn sampled_routes_emit_ar_tokens_for_each_seed_and_match_the_ar_distribution() {
    let target_dir = hf_bundle("llama-f32");
    let draft_dir = hf_bundle("llama-bf16"); // same tokenizer, different weights: q differs from p
    let cfg = SamplerConfig {
        temperature: 1.0,
        top_k: 6,
        ..SamplerConfig::default()
    };
    let be = Arc::new(CpuBackend::new(1).unwrap());
    let mut target = Engine::load(&target_dir, be.clone(), &SpecMode::Off).unwrap();
    let prompt = ids(&json(&target_dir.join("reference.json"))["token_ids"])[..6].to_vec();
    let exact = exact_pairs(&mut target.model, &prompt, cfg);

    let draft_model = |dir: &Path, fixed: Option<SamplerConfig>| -> Box<dyn Proposer> {
        let m = Model::load(&Bundle::open(dir).unwrap(), be.clone()).unwrap();
        Box::new(DraftModel::new(m, 320, fixed).unwrap())
    };
    let hot = SamplerConfig {
        temperature: 1.7,
        top_k: 0,
        ..SamplerConfig::default()
    };
    // A random MTP head drafting from half the vocabulary: its q differs from p everywhere and is zero on the
    // other half, the hardest case for the verifier.
    let head_dir = copy_bundle("llama-f32", "spec-mtp-sampled");
    let half: Vec<u32> = (0..320).step_by(2).collect();
    write_safetensors(
        &head_dir.join("mtp.safetensors"),
        &random_mtp_head(64, 4, 2, 16, 128, 21, Some(&half)),
        &[],
    );
    let head_bundle = Bundle::open(&head_dir).unwrap();
    let mtp: Box<dyn Proposer> = Box::new(
        MtpProposer::new(
            MtpHead::load(&head_bundle, &target.model).unwrap(),
            320,
            256,
        )
        .unwrap(),
    );
    let routes: Vec<(&str, Option<Box<dyn Proposer>>)> = vec![
        ("ar", None),
        ("mtp head (random), request sampling", Some(mtp)),
        (
            "other model, request sampling",
            Some(draft_model(&draft_dir, None)),
        ),
        (
            "other model, hotter q",
            Some(draft_model(&draft_dir, Some(hot))),
        ),
        (
            "self, greedy q",
            Some(draft_model(&target_dir, Some(SamplerConfig::greedy()))),
        ),
    ];
    let mut ar_samples = Vec::new();
    for (name, proposer) in routes {
        target.set_proposer(proposer);
        let (mut drafted, mut accepted) = (0, 0);
        let samples: Vec<(u32, u32)> = (0..3000u64)
            .map(|seed| {
                let req = GenerateRequest {
                    max_tokens: 2,
                    sampling: SamplerConfig { seed, ..cfg },
                    ignore_eos: true,
                    ..GenerateRequest::default()
                };
                let r = run(&mut target, &prompt, &req, None);
                drafted += r.stats.drafted;
                accepted += r.stats.accepted;
                (r.tokens[0], r.tokens[1])
            })
            .collect();
        if name == "ar" {
            let (chi, df) = chi_square(&exact, &samples);
            eprintln!(
                "ar: χ² = {chi:.1} on {df} df (critical {:.1})",
                chi_critical(df)
            );
            assert!(
                chi < chi_critical(df),
                "ar: χ² = {chi:.1} ≥ {:.1}",
                chi_critical(df)
            );
            ar_samples = samples;
        } else {
            eprintln!("{name}: {accepted} of {drafted} drafts kept");
            assert!(drafted > 0, "{name}: drafted nothing");
            let differ = (0..3000).filter(|&i| samples[i] != ar_samples[i]).count();
            assert_eq!(differ, 0, "{name}: {differ} of 3000 seeds differ from AR");
        }
    }
    // Power check: samples from the drafter's own distribution (what a verifier that always accepted would emit).
    let mut drafter = Engine::load(&draft_dir, be, &SpecMode::Off).unwrap();
    let biased: Vec<(u32, u32)> = (0..3000u64)
        .map(|seed| {
            let req = GenerateRequest {
                max_tokens: 2,
                sampling: SamplerConfig { seed, ..cfg },
                ignore_eos: true,
                speculate: false,
                ..GenerateRequest::default()
            };
            let r = run(&mut drafter, &prompt, &req, None);
            (r.tokens[0], r.tokens[1])
        })
        .collect();
    let (chi, df) = chi_square(&exact, &biased);
    assert!(
        chi > 3.0 * chi_critical(df),
        "the test cannot tell the drafter from the target (χ² = {chi:.1})"
    );
}
