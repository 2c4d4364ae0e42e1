//! The RAM prefix cache across conversations: a turn whose conversation was displaced from the session restores
//! its checkpoint (taken during prefill at the canonical boundary) and answers byte-identically to a cold run.

mod common;

use common::*;
use verity::backend::cpu::CpuBackend;
use verity::chat::{Message, TemplateArgs};
use verity::engine::{Engine, GenerateRequest, Session};
use verity::speculative::SpecMode;

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
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        match i % 2 {
            0 => {
                let n = bytes.len();
                bytes[n - 7] ^= 0x40; // corrupt the data: checksum mismatch
            }
            _ => bytes.truncate(bytes.len() - 100), // truncated
        }
        std::fs::write(f, bytes).unwrap();
    }
    // A half-written store of a process that died an hour ago, one in progress in a live process (left
    // alone), and a foreign model's file.
    let dead = dir.join(".tmp-999-x.vkv");
    std::fs::write(&dead, b"VRTYKV01 partial").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&dead)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
        .unwrap();
    std::fs::write(dir.join(".tmp-998-y.vkv"), b"VRTYKV01 in progress").unwrap();
    let foreign = std::fs::read(&files[0]).unwrap();
    let foreign = String::from_utf8_lossy(&foreign).replacen(
        &format!(
            "\"fingerprint\":\"{}\"",
            dir.file_name().unwrap().to_string_lossy()
        ),
        "\"fingerprint\":\"0000000000000000\"",
        1,
    );
    std::fs::write(dir.join("foreign.vkv"), foreign.as_bytes()).unwrap();
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
            .all(|n| n != ".tmp-999-x.vkv" && n != "foreign.vkv"),
        "rejected files are removed: {left:?}"
    );
    assert!(
        left.iter().any(|n| n == ".tmp-998-y.vkv"),
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
