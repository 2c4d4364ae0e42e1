//! `verity bench batch`: decode throughput of N sequences stepping together in batched forwards (what
//! continuous batching runs) against the same N sequences stepped one forward each, greedy, one token per
//! sequence per step; arms interleaved per repeat, medians. Each arm decodes from the same prompts, so their
//! tokens must agree exactly (a batched row is bitwise its own forward's): the record says whether they did.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use serde::Serialize;

use crate::device::{with_backend, Device, WithBackend};
use verity::backend::Backend;
use verity::bundle::Bundle;
use verity::cache::KvCache;
use verity::model::{Batch, LogitRows, Model, SeqForward, TargetFeatures};

use super::summary::median;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = verity_registry::DEFAULT_MODEL)]
    model: String,
    /// Numbers of sequences decoding at once.
    #[arg(long, default_value = "1,2,4,8,16")]
    streams: String,
    /// Tokens in each sequence's cache before it decodes (each sequence its own).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps per run.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One stream count's figures, as `--json` writes them.
#[derive(Serialize)]
struct Record {
    streams: usize,
    batched_tok_s: f64,
    sequential_tok_s: f64,
    /// batched / sequential.
    ratio: f64,
    /// Whether both arms decoded the same tokens in every run.
    identical: bool,
}

pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    with_backend(device, threads, BatchBench { a })
}

struct BatchBench {
    a: Args,
}

impl WithBackend for BatchBench {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _device: Device) -> Result<()> {
        run(self.a, backend)
    }
}

/// `n` sequences' caches, each holding its own `context` tokens, and each one's next token.
fn prompts<B: Backend>(
    model: &mut Model<B>,
    n: usize,
    context: usize,
) -> Result<(Vec<KvCache<B>>, Vec<u32>)> {
    let vocab = model.hp.vocab as u32;
    let mut caches = Vec::new();
    let mut next = Vec::new();
    for s in 0..n {
        // Deterministic, distinct per sequence, never all zeros.
        let tokens: Vec<u32> = (0..context)
            .map(|i| ((i * 7919 + s * 104_729 + 13) as u32) % vocab)
            .collect();
        let mut cache = model.new_cache(context + 1024);
        for chunk in tokens.chunks(64) {
            let pos = cache.len();
            model.forward(&mut cache, &Batch::causal(chunk, pos), LogitRows::None, &[])?;
        }
        caches.push(cache);
        next.push(tokens[context - 1].wrapping_add(1) % vocab);
    }
    Ok((caches, next))
}

/// `steps` greedy steps of every sequence, batched or one forward each: the tokens decoded (per sequence) and
/// the seconds taken.
fn decode<B: Backend>(
    model: &mut Model<B>,
    caches: &mut [KvCache<B>],
    mut next: Vec<u32>,
    steps: usize,
    batched: bool,
) -> Result<(Vec<Vec<u32>>, f64)> {
    let n = caches.len();
    let mut tokens = vec![Vec::with_capacity(steps); n];
    let t = Instant::now();
    for _ in 0..steps {
        let batches: Vec<Batch> = caches
            .iter()
            .zip(&next)
            .map(|(c, &tok)| Batch::causal(&[tok], c.len()))
            .collect();
        let outs = if batched {
            let mut seqs: Vec<SeqForward<B>> = caches
                .iter_mut()
                .zip(&batches)
                .map(|(cache, batch)| SeqForward {
                    cache,
                    batch,
                    logits: LogitRows::Greedy,
                    features: TargetFeatures::none(),
                })
                .collect();
            model.forward_batched(&mut seqs)?
        } else {
            caches
                .iter_mut()
                .zip(&batches)
                .map(|(cache, batch)| model.forward(cache, batch, LogitRows::Greedy, &[]))
                .collect::<verity::Result<Vec<_>>>()?
        };
        for (i, out) in outs.iter().enumerate() {
            next[i] = out.greedy[0];
            tokens[i].push(next[i]);
        }
    }
    Ok((tokens, t.elapsed().as_secs_f64()))
}

fn run<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    let path = crate::load::resolve(&a.model)?;
    let mut model = Model::load(&Bundle::open(&path)?, backend)?;
    let counts: Vec<usize> = a
        .streams
        .split(',')
        .map(|w| w.trim().parse())
        .collect::<Result<_, _>>()?;
    ensure!(
        a.context > 0 && a.steps > 0,
        "--context and --steps must be positive"
    );
    let mut records = Vec::new();
    println!(
        "{:>7} {:>12} {:>14} {:>7} {:>9}",
        "streams", "batched t/s", "sequential t/s", "ratio", "identical"
    );
    for &n in &counts {
        let (mut batched, mut sequential) = (Vec::new(), Vec::new());
        let mut identical = true;
        // A warm-up run of each arm, then `repeat` of each, alternating which goes first; each from freshly
        // prefilled caches.
        for rep in 0..a.repeat + 1 {
            let mut run_arm = |batched: bool| -> Result<(Vec<Vec<u32>>, f64)> {
                let (mut caches, next) = prompts(&mut model, n, a.context)?;
                decode(&mut model, &mut caches, next, a.steps, batched)
            };
            let ((tb, sb), (ts, ss)) = if rep % 2 == 0 {
                let b = run_arm(true)?;
                (b, run_arm(false)?)
            } else {
                let s = run_arm(false)?;
                (run_arm(true)?, s)
            };
            identical &= tb == ts;
            if rep > 0 {
                batched.push((n * a.steps) as f64 / sb);
                sequential.push((n * a.steps) as f64 / ss);
            }
        }
        let (b, s) = (median(batched), median(sequential));
        println!("{n:>7} {b:>12.1} {s:>14.1} {:>7.2} {identical:>9}", b / s);
        records.push(Record {
            streams: n,
            batched_tok_s: b,
            sequential_tok_s: s,
            ratio: b / s,
            identical,
        });
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&records)?)?;
    }
    Ok(())
}
