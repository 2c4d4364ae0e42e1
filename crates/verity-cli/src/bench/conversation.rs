//! `verity bench conversation`: the two-turn prompts with the prefix cache off, on (RAM) and on disk only. Every turn starts from a
//! fresh session, so turn 2 can reuse turn 1 only through the prefix cache; the arms are interleaved per
//! prompt and repeat. Reported: turn-2 TTFT, restored tokens, decode tok/s, tokens per cycle, and the time the
//! checkpoint store added (`store_s`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use verity::backend::cpu::CpuBackend;
use verity::engine::GenerateRequest;

use super::prompts;
use super::speed::{route_mode, run_prompt, write_json, Turns};
use super::summary::median;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = verity_registry::DEFAULT_MODEL)]
    model: String,
    /// Speculative route of both arms: ar, copy, draft_model (self-drafting) or auto.
    #[arg(long, default_value = "auto")]
    route: String,
    #[arg(long, default_value = "bench/prompts.jsonl")]
    prompts: PathBuf,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn main(a: Args, threads: usize) -> Result<()> {
    let prompts: Vec<_> = prompts::load(&a.prompts)?
        .into_iter()
        .filter(|p| !p.turns.is_empty())
        .collect();
    if prompts.is_empty() {
        bail!("{} has no two-turn (`turns`) prompts", a.prompts.display());
    }
    let backend = Arc::new(CpuBackend::new(threads)?);
    let target = crate::load::resolve(&a.model)?;
    let target = target.to_str().context("model path is not UTF-8")?;
    let mode = route_mode(&a.route, target)?;
    let mut arms = Vec::new();
    // off: nothing to restore; on: the RAM tier; disk: the disk tier alone (a restarted server).
    let disk_root =
        std::env::temp_dir().join(format!("verity-bench-prefix-{}", std::process::id()));
    for (label, budget, disk) in [
        ("off", 0usize, false),
        ("on", 1 << 30, false),
        ("disk", 0, true),
    ] {
        let mut e = crate::load::engine_on(target, backend.clone(), &mode)?;
        e.set_prefix_cache_budget(budget);
        if disk && !e.set_prefix_cache_dir(&disk_root, 1 << 32) {
            bail!("cannot use {} for the disk arm", disk_root.display());
        }
        arms.push((label, e));
    }
    let req = GenerateRequest::greedy(a.max_tokens);
    let mut records = Vec::new();
    for repeat in 0..a.repeat {
        for p in &prompts {
            for (label, engine) in arms.iter_mut() {
                engine.clear_prefix_cache();
                for mut r in run_prompt(engine, p, &a.route, repeat, &req, Turns::FreshSessions)? {
                    r.cache = Some(label.to_string());
                    records.push(r);
                }
            }
        }
    }
    write_json(a.json.as_deref(), &records)?;
    println!(
        "{:<6} {:>5} {:>10} {:>10} {:>10} {:>9} {:>10}",
        "cache", "runs", "ttft2 s", "restored", "tok/s", "tok/cyc", "store ms"
    );
    let _ = std::fs::remove_dir_all(&disk_root);
    for label in ["off", "on", "disk"] {
        let t2: Vec<_> = records
            .iter()
            .filter(|r| r.turn == 2 && r.cache.as_deref() == Some(label))
            .collect();
        let t1: Vec<_> = records
            .iter()
            .filter(|r| r.turn == 1 && r.cache.as_deref() == Some(label))
            .collect();
        println!(
            "{:<6} {:>5} {:>10.3} {:>10.0} {:>10.1} {:>9.2} {:>10.2}",
            label,
            t2.len(),
            median(t2.iter().map(|r| r.ttft_s).collect()),
            median(t2.iter().map(|r| r.restored_tokens as f64).collect()),
            median(t2.iter().map(|r| r.decode_tok_s).collect()),
            median(t2.iter().map(|r| r.accepted_per_cycle).collect()),
            median(t1.iter().map(|r| r.store_s * 1e3).collect()),
        );
    }
    Ok(())
}
