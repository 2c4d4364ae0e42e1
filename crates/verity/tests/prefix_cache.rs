//! The RAM prefix cache across conversations: a turn whose conversation was displaced from the session restores
//! its checkpoint (taken during prefill at the canonical boundary) and answers byte-identically to a cold run.

mod common;

use common::*;
use verity::backend::cpu::CpuBackend;
use verity::chat::Message;
use verity::engine::{Engine, GenerateRequest, Session};
use verity::spec::SpecMode;

fn turn(
    e: &mut Engine<CpuBackend>,
    sess: &mut Session<CpuBackend>,
    messages: &[Message],
) -> (String, usize, usize) {
    let (prompt, boundary) = e.chat_prompt_with_boundary(messages).unwrap();
    let req = GenerateRequest {
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
    for mode in [SpecMode::Off, SpecMode::Copy] {
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
        let first_turn = e.chat_prompt_with_boundary(&a[..1]).unwrap().1.unwrap();
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
