//! The RAM prefix cache across conversations: a turn whose conversation was displaced from the session restores
//! its checkpoint (taken during prefill at the canonical boundary) and answers byte-identically to a cold run.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use verity::backend::cpu::CpuBackend;
use verity::chat::{Message, TemplateArgs};
use verity::engine::{Engine, GenerateRequest, Session};
use verity::model::{BlockDrafter, MtpHead};
use verity::speculative::drafter::DrafterProposer;
use verity::speculative::mtp::MtpProposer;
use verity::speculative::{Draft, Outcome, Proposer, SpecMode};

fn turn(
    e: &mut Engine<CpuBackend>,
    sess: &mut Session<CpuBackend>,
    messages: &[Message],
) -> (String, usize, usize) {
    let p = e.render_chat(messages, &TemplateArgs::default()).unwrap();
    let (prompt, boundary) = (p.tokens, p.boundary);
    let req = GenerateRequest {
        constraint: None,
        store_prefix: boundary,
        ..GenerateRequest::greedy(24)
    };
    let mut ids = Vec::new();
    let stats = e
        .generate(sess, &prompt, &req, |_, t| {
            ids.push(t.id);
            true
        })
        .unwrap();
    (
        e.tokenizer.decode(&ids).unwrap(),
        stats.restored_tokens,
        boundary.unwrap(),
    )
}

#[test]
fn a_displaced_conversation_restores_from_the_prefix_cache_and_answers_like_a_cold_run() {
    // The draft model (here the target drafting for itself) keeps its own cache: after a restore it catches up
    // by prefilling exactly the tokens it lacks, which must not change a single output token.
    for mode in [
        SpecMode::Off,
        SpecMode::Copy,
        SpecMode::DraftModel(Some(smollm2())),
    ] {
        let mut e = Engine::load(&smollm2(), backend(), &mode).unwrap();
        e.set_prefix_cache_budget(256 << 20);
        let mut sess = e.new_session();
        let mut a = vec![Message::new("user", "Name three colors of the rainbow.")];
        let (a1, _, _) = turn(&mut e, &mut sess, &a);
        a.push(Message::new("assistant", &a1));
        // Another conversation takes the session.
        turn(
            &mut e,
            &mut sess,
            &[Message::new("user", "What is two plus two?")],
        );
        a.push(Message::new("user", "And three more?"));
        let (warm, restored, boundary) = turn(&mut e, &mut sess, &a);
        let first_turn = e
            .render_chat(&a[..1], &TemplateArgs::default())
            .unwrap()
            .boundary
            .unwrap();
        assert!(
            restored >= first_turn,
            "{mode:?}: restored {restored} < first turn's boundary {first_turn}"
        );
        assert!(restored < boundary);
        // Cold: a fresh engine with no cache at all.
        let mut cold_engine = Engine::load(&smollm2(), backend(), &mode).unwrap();
        let mut cold_sess = cold_engine.new_session();
        let (cold, cold_restored, _) = turn(&mut cold_engine, &mut cold_sess, &a);
        assert_eq!(cold_restored, 0);
        assert_eq!(
            warm, cold,
            "{mode:?}: a restored turn must answer exactly like a cold run"
        );
    }
}

/// A mixture of experts (the tiny Qwen3-MoE bundles, safetensors and GGUF): a displaced conversation's next turn
/// restores its checkpoint and answers exactly like a cold run.
#[test]
fn a_mixture_of_experts_conversation_restores_like_a_cold_run() {
    // Token prompts (the tiny tokenizer's template marks no turn boundary): each turn stores a checkpoint at
    // the end of its prompt and after its answer.
    let raw_turn = |e: &mut Engine<CpuBackend>, sess: &mut Session<CpuBackend>, prompt: &[u32]| {
        // The random models' stop token may come first; the answer (and its checkpoint) must not be empty.
        let req = GenerateRequest {
            constraint: None,
            store_prefix: Some(prompt.len()),
            ignore_eos: true,
            ..GenerateRequest::greedy(16)
        };
        let mut ids = Vec::new();
        let stats = e
            .generate(sess, prompt, &req, |_, t| {
                ids.push(t.id);
                true
            })
            .unwrap();
        (ids, stats.restored_tokens)
    };
    for name in [
        "qwen3-moe-f16",
        "qwen3-moe-gguf",
        "qwen3-next-f16",
        "qwen3-next-gguf",
    ] {
        let path = hf_bundle(name);
        let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
        e.set_prefix_cache_budget(64 << 20);
        let mut sess = e.new_session();
        let first: Vec<u32> = (10..40).collect();
        let (answer, _) = raw_turn(&mut e, &mut sess, &first);
        raw_turn(&mut e, &mut sess, &(50..70).collect::<Vec<u32>>());
        let next: Vec<u32> = first
            .iter()
            .chain(&answer)
            .chain(&[80, 81, 82])
            .copied()
            .collect();
        let (warm, restored) = raw_turn(&mut e, &mut sess, &next);
        assert!(restored >= first.len(), "{name}: restored {restored}");
        let mut cold_engine = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
        let mut cold_sess = cold_engine.new_session();
        let (cold, cold_restored) = raw_turn(&mut cold_engine, &mut cold_sess, &next);
        assert_eq!(cold_restored, 0);
        assert_eq!(
            warm, cold,
            "{name}: a restored turn must answer like a cold run"
        );
    }
}

/// Gemma 3 270M past its 512-token window and its rings' first wrap: an 800-token prompt's checkpoint (its
/// local layers' last windows, the global layers' everything), restored from RAM and (after a restart) from
/// disk for a longer prompt, answers exactly like a cold run, and its cache is the cold run's bit for bit.
#[test]
fn a_gemma3_checkpoint_past_the_window_restores_like_a_cold_run_from_ram_and_disk() {
    let path = gemma3_270m();
    let root = scratch("prefix-gemma3");
    let generate = |e: &mut Engine<CpuBackend>, prompt: &[u32], store: Option<usize>| {
        answer_and_state(e, prompt, store, 24)
    };
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let long = gemma3_prompt(&e.tokenizer, 900);
    let (first, second) = (&long[..800], &long[..900]);
    e.set_prefix_cache_budget(256 << 20);
    assert!(e.set_prefix_cache_dir(&root, 1 << 30));
    generate(&mut e, first, Some(first.len()));
    let mut cold_engine = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let cold = generate(&mut cold_engine, second, None);
    assert_eq!(cold.1, 0);
    let warm = generate(&mut e, second, None);
    // At least the stored prompt (the first turn's answer, when it continues the text, is stored too).
    assert!(warm.1 >= first.len(), "restored {} from RAM", warm.1);
    drop(e);
    let mut restarted = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    assert!(restarted.set_prefix_cache_dir(&root, 1 << 30));
    let disk = generate(&mut restarted, second, None);
    assert!(disk.1 >= first.len(), "restored {} from disk", disk.1);
    for (label, run) in [("RAM", &warm), ("disk", &disk)] {
        assert_eq!(run.0, cold.0, "{label}: tokens differ from the cold run");
        assert!(
            run.2 == cold.2,
            "{label}: cache differs from the cold run's"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A hybrid of Gated DeltaNet and attention layers (Qwen3-Next): a checkpoint carries each recurrent layer's
/// state at its boundary; restored from RAM and (after a restart) from disk for a longer prompt, the turn
/// answers exactly like a cold run, and its K/V and recurrent states are the cold run's bit for bit.
#[test]
fn a_linear_attention_checkpoint_restores_its_recurrent_state_from_ram_and_disk() {
    let path = hf_bundle("qwen3-next-f16");
    let root = scratch("prefix-qwen3-next");
    let generate = |e: &mut Engine<CpuBackend>, prompt: &[u32], store: Option<usize>| {
        answer_and_state(e, prompt, store, 16)
    };
    // The first prompt's checkpoint at 50 tokens (prefill stops before a prompt's last token).
    let (first, second): (Vec<u32>, Vec<u32>) = ((10..61).collect(), (10..75).collect());
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    e.set_prefix_cache_budget(64 << 20);
    assert!(e.set_prefix_cache_dir(&root, 1 << 30));
    generate(&mut e, &first, Some(50));
    let mut cold_engine = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let cold = generate(&mut cold_engine, &second, None);
    assert_eq!(cold.1, 0);
    let warm = generate(&mut e, &second, None);
    assert_eq!(warm.1, 50, "restored from RAM");
    drop(e);
    let mut restarted = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    assert!(restarted.set_prefix_cache_dir(&root, 1 << 30));
    let disk = generate(&mut restarted, &second, None);
    assert_eq!(disk.1, 50, "restored from disk");
    for (label, run) in [("RAM", &warm), ("disk", &disk)] {
        assert_eq!(run.0, cold.0, "{label}: tokens differ from the cold run");
        assert!(
            run.2 == cold.2,
            "{label}: K/V or recurrent state differs from the cold run's"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The disk tier: a new engine (a restart) restores from the folder; corrupted, truncated, foreign and
/// half-written files are rejected (and removed), and the answer is still identical to a cold run.
#[test]
fn the_disk_tier_survives_a_restart_and_rejects_damaged_files() {
    let root = std::env::temp_dir().join(format!("verity-prefix-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let conversation = |e: &mut Engine<CpuBackend>| -> Vec<Message> {
        let mut sess = e.new_session();
        let mut a = vec![Message::new("user", "Name three colors of the rainbow.")];
        let (a1, _, _) = turn(e, &mut sess, &a);
        a.push(Message::new("assistant", &a1));
        a.push(Message::new("user", "And three more?"));
        a
    };
    // First "process": answer turn 1 with the disk tier on (RAM tier off, so only the disk can restore).
    let mut first = Engine::load(&smollm2(), backend(), &SpecMode::Off).unwrap();
    assert!(first.set_prefix_cache_dir(&root, 1 << 30));
    let msgs = conversation(&mut first);
    let files = first.prefix_disk().unwrap().list();
    assert_eq!(files.len(), 2, "the boundary and the answer: {files:?}");
    let dir = first.prefix_disk().unwrap().dir().to_path_buf();
    drop(first);

    let cold = {
        let mut e = Engine::load(&smollm2(), backend(), &SpecMode::Off).unwrap();
        let mut s = e.new_session();
        turn(&mut e, &mut s, &msgs).0
    };
    let restart = |expect_restore: bool| -> String {
        let mut e = Engine::load(&smollm2(), backend(), &SpecMode::Off).unwrap();
        assert!(e.set_prefix_cache_dir(&root, 1 << 30));
        let mut s = e.new_session();
        let (text, restored, _) = turn(&mut e, &mut s, &msgs);
        assert_eq!(restored > 0, expect_restore, "restored {restored}");
        text
    };
    assert_eq!(restart(true), cold, "restored from disk after a restart");

    let longest = || {
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "vkv"))
            .collect();
        files.sort_by_key(|p| std::fs::metadata(p).unwrap().len());
        files
    };
    // Damage every stored file in a different way; each must be rejected.
    let files = longest();
    let intact = std::fs::read(&files[0]).unwrap();
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        match i % 2 {
            0 => {
                let n = bytes.len();
                bytes[n - 23] ^= 0x40; // corrupt the data (before the 16-byte checksum): checksum mismatch
            }
            _ => bytes.truncate(bytes.len() - 100), // truncated
        }
        std::fs::write(f, bytes).unwrap();
    }
    // A half-written store of a process that no longer exists (above the kernel's largest process id; written
    // just now: its age does not matter), one in progress in a live process (process 1; left alone), and a
    // foreign model's file.
    std::fs::write(dir.join(".tmp-4194304-0-x.vkv"), b"VRTYKV02 partial").unwrap();
    std::fs::write(dir.join(".tmp-1-0-y.vkv"), b"VRTYKV02 in progress").unwrap();
    let mut foreign = intact;
    let at = foreign
        .windows(9)
        .position(|w| w == b"\"model\":\"")
        .expect("a model field")
        + 9;
    foreign[at..at + 16].copy_from_slice(b"0000000000000000");
    std::fs::write(dir.join("foreign.vkv"), &foreign).unwrap();
    assert_eq!(
        restart(false),
        cold,
        "damaged files are skipped and the answer is unchanged"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter()
            .all(|n| n != ".tmp-4194304-0-x.vkv" && n != "foreign.vkv"),
        "rejected files are removed: {left:?}"
    );
    assert!(
        left.iter().any(|n| n == ".tmp-1-0-y.vkv"),
        "another process's store in progress is left alone: {left:?}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_unusable_cache_folder_turns_the_disk_tier_off_without_affecting_answers() {
    let mut e = Engine::load(&smollm2(), backend(), &SpecMode::Off).unwrap();
    assert!(!e.set_prefix_cache_dir(std::path::Path::new("/proc/verity-no-such-folder"), 1 << 30));
    let mut s = e.new_session();
    let (text, _, _) = turn(
        &mut e,
        &mut s,
        &[Message::new("user", "What is the capital of Japan?")],
    );
    assert!(text.contains("Tokyo"), "{text:?}");
}

/// A scratch folder for one test, empty.
/// A greedy answer of up to `max` tokens to `prompt` in a new session (storing a checkpoint at `store`), the
/// prompt tokens restored, and the session's state afterwards as bits: each layer's K and V, then each
/// recurrent layer's state.
fn answer_and_state(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    store: Option<usize>,
    max: usize,
) -> (Vec<u32>, usize, Vec<Vec<u32>>) {
    let mut sess = e.new_session();
    let req = GenerateRequest {
        store_prefix: store,
        ignore_eos: true,
        ..GenerateRequest::greedy(max)
    };
    let mut ids = Vec::new();
    let stats = e
        .generate(&mut sess, prompt, &req, |_, t| {
            ids.push(t.id);
            true
        })
        .unwrap();
    let ckpt = sess.cache.checkpoint(e.model.backend());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut state: Vec<Vec<u32>> = ckpt
        .layers()
        .iter()
        .flat_map(|(k, v)| [bits(k), bits(v)])
        .collect();
    state.extend(ckpt.recurrent().into_iter().flatten().map(|s| bits(s)));
    (ids, stats.restored_tokens, state)
}

fn scratch(test: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("verity-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    root
}

/// Turn 1 of a conversation on `model` with the disk tier under `root` (storing its checkpoints), and the
/// messages of turn 2.
fn first_turn(model: &Path, be: Arc<CpuBackend>, root: &Path) -> Vec<Message> {
    let mut e = Engine::load(model, be, &SpecMode::Off).unwrap();
    assert!(e.set_prefix_cache_dir(root, 1 << 30));
    let mut s = e.new_session();
    let mut msgs = vec![Message::new("user", "Name three colors of the rainbow.")];
    let (a1, _, _) = turn(&mut e, &mut s, &msgs);
    assert!(!e.prefix_disk().unwrap().list().is_empty());
    msgs.push(Message::new("assistant", &a1));
    msgs.push(Message::new("user", "And three more?"));
    msgs
}

/// Turn 2 on `model` in a new engine: with the disk tier under `root` (the answer and the restored tokens),
/// or with no cache at all (`root` = None).
fn second_turn(
    model: &Path,
    be: Arc<CpuBackend>,
    root: Option<&Path>,
    msgs: &[Message],
) -> (String, usize) {
    let mut e = Engine::load(model, be, &SpecMode::Off).unwrap();
    if let Some(root) = root {
        assert!(e.set_prefix_cache_dir(root, 1 << 30));
    }
    let mut s = e.new_session();
    let (text, restored, _) = turn(&mut e, &mut s, msgs);
    (text, restored)
}

/// A copy of the bundle's GGUF in `dir` with the original's modification time, and `change` applied to the
/// data of tensor `name`.
fn copy_gguf(dir: &Path, name: &str, change: impl Fn(&mut [u8])) -> PathBuf {
    let original = smollm2();
    let copy = dir.join(original.file_name().unwrap());
    std::fs::copy(&original, &copy).unwrap();
    let range = verity::bundle::gguf::GgufFile::open(&copy)
        .unwrap()
        .tensor(name)
        .unwrap_or_else(|| panic!("{name} in the GGUF"))
        .range
        .clone();
    let mut bytes = std::fs::read(&copy).unwrap();
    change(&mut bytes[range]);
    std::fs::write(&copy, &bytes).unwrap();
    let mtime = std::fs::metadata(&original).unwrap().modified().unwrap();
    std::fs::File::options()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    copy
}

/// The fingerprint samples the weights: a copy whose only difference is a few bytes at the start of one
/// tensor (same size, same modification time) never restores the original's checkpoints, and answers like a
/// cold run of itself; an identical copy does share them (so the check is not vacuous).
#[test]
fn a_changed_weight_tensor_never_restores_the_original_models_checkpoints() {
    let root = scratch("prefix-weights");
    let msgs = first_turn(&smollm2(), backend(), &root.join("cache"));

    let same_dir = root.join("same");
    std::fs::create_dir_all(&same_dir).unwrap();
    let same = copy_gguf(&same_dir, "blk.0.attn_q.weight", |_| {});
    let (same_text, same_restored) =
        second_turn(&same, backend(), Some(&root.join("cache")), &msgs);
    assert!(
        same_restored > 0,
        "an identical copy shares the checkpoints"
    );

    let changed_dir = root.join("changed");
    std::fs::create_dir_all(&changed_dir).unwrap();
    let changed = copy_gguf(&changed_dir, "blk.0.attn_q.weight", |data| {
        // The first Q4_1 blocks' scales and minimums: a different model, still finite.
        for b in data[..64].iter_mut() {
            *b ^= 0x01;
        }
    });
    let (warm, restored) = second_turn(&changed, backend(), Some(&root.join("cache")), &msgs);
    assert_eq!(
        restored, 0,
        "the changed model restored the original's checkpoint"
    );
    let (cold, _) = second_turn(&changed, backend(), None, &msgs);
    assert_eq!(
        warm, cold,
        "the changed model answers like a cold run of itself"
    );
    let (original_cold, _) = second_turn(&smollm2(), backend(), None, &msgs);
    assert_eq!(same_text, original_cold);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Checkpoints computed with 8-bit activations are never restored under f32 activations (the numerics differ
/// in bits), and the other way round.
#[test]
fn checkpoints_of_other_activations_are_never_restored() {
    let root = scratch("prefix-numerics");
    let msgs = first_turn(&smollm2(), backend(), &root);
    let (warm, restored) = second_turn(&smollm2(), f32_backend(), Some(&root), &msgs);
    assert_eq!(restored, 0, "f32 activations restored a Q8 checkpoint");
    let (cold, _) = second_turn(&smollm2(), f32_backend(), None, &msgs);
    assert_eq!(warm, cold);
    // The f32 run stored its own; Q8 still restores only its own, and answers like a cold Q8 run.
    let (q8_warm, q8_restored) = second_turn(&smollm2(), backend(), Some(&root), &msgs);
    assert!(q8_restored > 0);
    let (q8_cold, _) = second_turn(&smollm2(), backend(), None, &msgs);
    assert_eq!(q8_warm, q8_cold);
    let folders = std::fs::read_dir(&root).unwrap().count();
    assert_eq!(folders, 2, "a folder per numerics");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Each proposal an MTP head made during a turn: the context length it drafted after and its tokens.
type Proposals = Arc<std::sync::Mutex<Vec<(usize, Vec<u32>)>>>;

/// The bundle's MTP head, its proposals logged.
struct Logged {
    head: Box<dyn Proposer>,
    log: Proposals,
}

impl Proposer for Logged {
    fn name(&self) -> &'static str {
        "logged"
    }
    fn reset(&mut self, sampling: &verity::sample::SamplerConfig) {
        self.head.reset(sampling);
    }
    fn propose(&mut self, context: &[u32], k: usize) -> verity::Result<Draft> {
        let d = self.head.propose(context, k)?;
        let mut log = self.log.lock().unwrap();
        log.push((context.len(), d.tokens().to_vec()));
        Ok(d)
    }
    fn observe(&mut self, outcome: &Outcome) {
        self.head.observe(outcome);
    }
    fn features(&self) -> verity::model::TargetFeatures {
        self.head.features()
    }
    fn observe_hidden(&mut self, start: usize, hidden: &[f32]) {
        self.head.observe_hidden(start, hidden);
    }
}

/// An engine on the SmolLM2 bundle with a (random) block drafter whose proposer is the drafter, logged.
fn logged_drafter_engine() -> (Engine<CpuBackend>, Proposals) {
    let path = smollm2_with_drafter();
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let bundle = verity::bundle::Bundle::open(&path).unwrap();
    let drafter = BlockDrafter::load(&bundle, &e.model).unwrap();
    let ctx = e.model.hp.context_len;
    let log = Proposals::default();
    e.set_proposer(Some(Box::new(Logged {
        head: Box::new(DrafterProposer::new(drafter, e.model.hp.vocab, ctx).unwrap()),
        log: log.clone(),
    })));
    (e, log)
}

/// An engine on the MTP bundle whose proposer is its head, logged.
fn logged_mtp_engine() -> (Engine<CpuBackend>, Proposals) {
    let path = smollm2_mtp();
    let mut e = Engine::load(&path, backend(), &SpecMode::Off).unwrap();
    let bundle = verity::bundle::Bundle::open(&path).unwrap();
    let head = MtpHead::load(&bundle, &e.model).unwrap();
    let (vocab, ctx) = (e.model.hp.vocab, e.model.hp.context_len);
    let log = Proposals::default();
    e.set_proposer(Some(Box::new(Logged {
        head: Box::new(MtpProposer::new(head, vocab, ctx).unwrap()),
        log: log.clone(),
    })));
    (e, log)
}

/// A turn restored from the RAM tier (another conversation took the session) or from the disk tier (a new
/// engine) hands the MTP head the target's hidden states of the whole restored prefix, so the head drafts what
/// it drafts in a cold run of the same turn. Without them it would condition only on the newly prefilled part.
#[test]
fn a_restored_turn_drafts_like_a_cold_one_on_the_mtp_route_from_ram_and_from_disk() {
    restored_turns_draft_like_cold_ones(logged_mtp_engine, "mtp");
}

/// The same for a block drafter: the checkpoint carries the target's states at the drafter's layers, so its
/// context after a restore is the cold run's.
#[test]
fn a_restored_turn_drafts_like_a_cold_one_on_the_drafter_route_from_ram_and_from_disk() {
    restored_turns_draft_like_cold_ones(logged_drafter_engine, "drafter");
}

fn restored_turns_draft_like_cold_ones(
    engine: fn() -> (Engine<CpuBackend>, Proposals),
    route: &str,
) {
    let first = vec![Message::new("user", "Name three colors of the rainbow.")];
    let (mut cold, cold_log) = engine();
    let mut s = cold.new_session();
    let (a1, _, _) = turn(&mut cold, &mut s, &first);
    let mut msgs = first.clone();
    msgs.push(Message::new("assistant", &a1));
    msgs.push(Message::new("user", "And three more?"));
    let mut s = cold.new_session();
    cold_log.lock().unwrap().clear();
    let (cold_text, cold_restored, _) = turn(&mut cold, &mut s, &msgs);
    assert_eq!(cold_restored, 0);
    let cold_drafts = cold_log.lock().unwrap().clone();
    assert!(!cold_drafts.is_empty());

    for tier in ["ram", "disk"] {
        let root = scratch(&format!("{route}-restore-{tier}"));
        let (mut e, mut log) = engine();
        assert!(e.set_prefix_cache_dir(&root, 1 << 30));
        let mut s = e.new_session();
        turn(&mut e, &mut s, &first);
        if tier == "ram" {
            // Another conversation takes the session.
            turn(
                &mut e,
                &mut s,
                &[Message::new("user", "What is two plus two?")],
            );
        } else {
            // A restart: a new engine, its RAM tier empty (dropping the old one finishes its disk stores).
            drop(s);
            (e, log) = engine();
            assert!(e.set_prefix_cache_dir(&root, 1 << 30));
            s = e.new_session();
        }
        log.lock().unwrap().clear();
        let (text, restored, _) = turn(&mut e, &mut s, &msgs);
        assert!(restored > 0, "{tier}: nothing restored");
        assert_eq!(text, cold_text, "{tier}");
        let drafts = log.lock().unwrap().clone();
        // The first cycle's width is the controller's prior, the same in both runs; later widths follow timings.
        assert_eq!(
            drafts[0], cold_drafts[0],
            "{route}, {tier}: the first draft after the restore"
        );
        // The engine's writer finishes its stores before the folder goes.
        drop((s, e));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
