//! `verity bench conversation`: the two-turn prompts with the prefix cache off, on (RAM) and on disk only. Every turn starts from a
//! fresh session, so turn 2 can reuse turn 1 only through the prefix cache; the arms are interleaved per
//! prompt and repeat, run on one loaded model (each arm's cache set up before its runs, every conversation
//! forgotten before each prompt), so they differ in nothing but the cache. Reported: turn-2 TTFT, restored tokens, decode tok/s, tokens per cycle, and the time the
//! checkpoint store added (`store_s`). The disk arm forgets every conversation between the turns
//! ([`verity::engine::Engine::forget_conversations`]): turn 2 runs as after a restart, the proposer's state
//! included. `--width K` fixes the draft width, so tokens per cycle depend on the proposer's state alone, not on
//! the controller's timing-driven choices: with it, a restored turn must accept exactly what the cold one does.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use verity::backend::Backend;
use verity::engine::GenerateRequest;

use super::prompts;
use super::speed::{route_mode, run_prompt, write_json, Turns};
use super::summary::{median, Record};
use crate::device::{Device, WithBackend};

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
    /// Draft exactly this many tokens per cycle (at most what the proposer offers) instead of the controller's
    /// choice.
    #[arg(long)]
    width: Option<usize>,
    /// Show this image (PNG or JPEG) in each conversation's first user message, sent again with every turn (an
    /// image-text folder): its features are computed afresh in each conversation's first turn (and, in the disk
    /// arm, after the restart), and the time they took is reported beside the times to first token.
    #[arg(long, value_name = "FILE")]
    image: Option<PathBuf>,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw turn-2 time to first token per arm as DIR/conversation.png (the folder is created).
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        run(self, backend)
    }
}

fn run<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    // The folder first, so that an unusable one fails before the measurement.
    let plot = a
        .plot
        .as_deref()
        .map(|dir| super::plot::png_path(dir, "conversation"))
        .transpose()?;
    let prompts: Vec<_> = prompts::load(&a.prompts)?
        .into_iter()
        .filter(|p| !p.turns.is_empty())
        .collect();
    if prompts.is_empty() {
        bail!("{} has no two-turn (`turns`) prompts", a.prompts.display());
    }
    let target = crate::load::resolve(&a.model)?;
    let target = target.to_str().context("model path is not UTF-8")?;
    let mode = route_mode(&a.route, target)?;
    let mut engine = crate::load::engine_on(target, backend.clone(), &mode)?;
    let image = a
        .image
        .as_deref()
        .map(|p| std::fs::read(p).with_context(|| format!("reading {}", p.display())))
        .transpose()?;
    // off: nothing to restore; on: the RAM tier; disk: the disk tier alone (a restarted server).
    let disk_root =
        std::env::temp_dir().join(format!("verity-bench-prefix-{}", std::process::id()));
    let setups: [(&str, usize, bool); 3] =
        [("off", 0, false), ("on", 1 << 30, false), ("disk", 0, true)];
    let req = GenerateRequest {
        draft_width: a.width,
        ..GenerateRequest::greedy(a.max_tokens)
    };
    let mut records = Vec::new();
    for repeat in 0..a.repeat {
        for p in &prompts {
            for &(label, budget, disk) in &setups {
                engine.set_prefix_cache_budget(budget);
                if !disk {
                    engine.close_prefix_cache_dir();
                } else if !engine.set_prefix_cache_dir(&disk_root, 1 << 32) {
                    bail!("cannot use {} for the disk arm", disk_root.display());
                }
                engine.clear_prefix_cache();
                engine.forget_conversations();
                let turns = if disk {
                    Turns::Restarted
                } else {
                    Turns::FreshSessions
                };
                let runs = run_prompt(
                    &mut engine,
                    p,
                    &a.route,
                    repeat,
                    &req,
                    turns,
                    image.as_deref(),
                )?;
                for mut r in runs {
                    r.cache = Some(label.to_string());
                    records.push(r);
                }
            }
        }
    }
    write_json(a.json.as_deref(), &records)?;
    // The engine's disk writer finishes its stores before the folder goes.
    drop(engine);
    let _ = std::fs::remove_dir_all(&disk_root);
    let images = image.is_some();
    let columns = if images {
        format!(" {:>9} {:>9}", "image1 s", "image2 s")
    } else {
        String::new()
    };
    println!(
        "{:<6} {:>5} {:>10} {:>10} {:>10} {:>9} {:>10}{columns}",
        "cache", "runs", "ttft2 s", "restored", "tok/s", "tok/cyc", "store ms"
    );
    for arm in arms(&records) {
        let columns = if images {
            format!(" {:>9.3} {:>9.3}", arm.image_s[0], arm.image_s[1])
        } else {
            String::new()
        };
        println!(
            "{:<6} {:>5} {:>10.3} {:>10.0} {:>10.1} {:>9.2} {:>10.2}{columns}",
            arm.cache,
            arm.runs,
            arm.ttft2_s,
            arm.restored_tokens,
            arm.decode_tok_s,
            arm.accepted_per_cycle,
            arm.store_ms,
        );
    }
    if let Some(path) = &plot {
        super::plot::conversation(&records, &format!("route {}", a.route), path)?;
        eprintln!("plot: {}", path.display());
    }
    Ok(())
}

/// One prefix-cache arm, medians over its turn-2 runs (store time over turn 1, where the checkpoint is stored).
pub struct Arm {
    pub cache: &'static str,
    pub runs: usize,
    pub ttft2_s: f64,
    pub restored_tokens: f64,
    pub decode_tok_s: f64,
    pub accepted_per_cycle: f64,
    pub store_ms: f64,
    /// The image's time in turns 1 and 2 (`--image`, the records' `image_s`; 0 without).
    pub image_s: [f64; 2],
}

/// The arms `off`, `on` and `disk`, in that order (an arm without records has `runs` 0 and NaN medians).
pub fn arms(records: &[Record]) -> Vec<Arm> {
    ["off", "on", "disk"]
        .into_iter()
        .map(|cache| {
            let of_turn = |turn: usize| -> Vec<&Record> {
                records
                    .iter()
                    .filter(|r| r.turn == turn && r.cache.as_deref() == Some(cache))
                    .collect()
            };
            let (t1, t2) = (of_turn(1), of_turn(2));
            Arm {
                cache,
                runs: t2.len(),
                ttft2_s: median(t2.iter().map(|r| r.ttft_s).collect()),
                restored_tokens: median(t2.iter().map(|r| r.restored_tokens as f64).collect()),
                decode_tok_s: median(t2.iter().map(|r| r.decode_tok_s).collect()),
                accepted_per_cycle: median(t2.iter().map(|r| r.accepted_per_cycle).collect()),
                store_ms: median(t1.iter().map(|r| r.store_s * 1e3).collect()),
                image_s: [&t1, &t2].map(|t| median(t.iter().map(|r| r.image_s).collect())),
            }
        })
        .collect()
}
