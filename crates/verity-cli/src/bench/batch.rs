//! `verity bench batch`: decode throughput of N sequences stepping together in batched forwards (what
//! continuous batching runs) against the same N sequences stepped one forward each, greedy, one token per
//! sequence per step; arms interleaved per repeat, medians. Each arm decodes from the same prompts, so their
//! tokens must agree exactly (a batched row is bitwise its own forward's): the record says whether they did.
//!
//! With `--draft-depth D` (a bundle with an MTP head or a block drafter) it also times the drafting for the N
//! sequences: each step every sequence brings its drafting model up to one more committed position and drafts
//! `D` tokens, in one batched call ([`MtpHead::draft_greedy_batched`], [`BlockDrafter::draft_batched`]) against
//! one draft per sequence — what a batched step's per-request drafting costs either way; the drafts must agree
//! exactly too. A bundle with both times its MTP head.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use serde::Serialize;

use crate::device::{with_backend, Device, WithBackend};
use verity::backend::Backend;
use verity::bundle::Bundle;
use verity::bundle::{DrafterStatus, MtpStatus};
use verity::cache::KvCache;
use verity::model::{
    Batch, BlockDraft, BlockDrafter, HeadDraft, LogitRows, Model, MtpHead, SeqForward,
    TargetFeatures,
};

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
    /// Also time the drafts of this depth (an MTP head's, else a block drafter's) for the sequences, batched and
    /// one per sequence (0: off).
    #[arg(long, default_value_t = 0)]
    draft_depth: usize,
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
    /// With `--draft-depth`: milliseconds per step of the sequences' drafting, batched and one per sequence.
    #[serde(skip_serializing_if = "Option::is_none")]
    drafting: Option<Drafting>,
}

#[derive(Serialize)]
struct Drafting {
    /// "mtp" or "drafter".
    model: &'static str,
    depth: usize,
    batched_ms: f64,
    sequential_ms: f64,
    /// sequential / batched.
    speedup: f64,
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

/// The drafting model `--draft-depth` times.
enum Drafter<B: Backend> {
    Head(MtpHead<B>),
    Block(BlockDrafter<B>),
}

impl<B: Backend> Drafter<B> {
    /// The bundle's MTP head, else its block drafter.
    fn load(bundle: &Bundle, model: &Model<B>) -> Result<Self> {
        if let MtpStatus::Complete(_) = bundle.mtp {
            return Ok(Drafter::Head(MtpHead::load(bundle, model)?));
        }
        if let DrafterStatus::Complete(_) = bundle.drafter {
            return Ok(Drafter::Block(BlockDrafter::load(bundle, model)?));
        }
        anyhow::bail!("--draft-depth needs a bundle with an MTP head or a block drafter")
    }

    fn name(&self) -> &'static str {
        match self {
            Drafter::Head(_) => "mtp",
            Drafter::Block(_) => "drafter",
        }
    }

    /// The target states it conditions on.
    fn features(&self) -> TargetFeatures {
        match self {
            Drafter::Head(_) => TargetFeatures::final_state(),
            Drafter::Block(d) => TargetFeatures::layers(d.spec().target_layers.clone()),
        }
    }
}

/// `n` sequences' target `features` at positions `0..len` (each its own tokens), and their tokens.
fn states<B: Backend>(
    model: &mut Model<B>,
    n: usize,
    len: usize,
    features: &TargetFeatures,
) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
    let vocab = model.hp.vocab as u32;
    (0..n)
        .map(|s| {
            let tokens: Vec<u32> = (0..len)
                .map(|i| ((i * 7919 + s * 104_729 + 13) as u32) % vocab)
                .collect();
            let mut cache = model.new_cache(len);
            let mut states = Vec::new();
            for (c, chunk) in tokens.chunks(64).enumerate() {
                let batch = Batch::causal(chunk, c * 64);
                let out = model.forward_features(&mut cache, &batch, LogitRows::None, features)?;
                states.extend(out.features);
            }
            Ok((tokens, states))
        })
        .collect()
}

/// What the drafting arms walk: `steps` steps from position `context`, each drafting `depth` tokens.
#[derive(Clone, Copy)]
struct Walk {
    context: usize,
    steps: usize,
    depth: usize,
}

/// [`head_steps`] for a block drafter: each step every sequence adds the context of one more committed
/// position and drafts a block of `depth` positions, in one batched call for all sequences (the new context
/// rows together, then the blocks) or one pair of calls per sequence. The drafts' logits (as bits) and the
/// seconds taken.
fn block_steps<B: Backend>(
    drafter: &mut BlockDrafter<B>,
    seqs: &[(Vec<u32>, Vec<f32>)],
    walk: Walk,
    batched: bool,
) -> Result<(Vec<Vec<u32>>, f64)> {
    let w = drafter.state_width();
    // Contexts of positions 0..context - 1 (slot i holds position i): each step adds the one before its pending
    // token.
    let mut caches = Vec::new();
    for (_, states) in seqs {
        let mut c = drafter.new_cache(walk.context + walk.steps + walk.depth + 1);
        drafter.extend_context(&mut c, 0, &states[..(walk.context - 1) * w])?;
        caches.push(c);
    }
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut drafts = Vec::new();
    let t = Instant::now();
    for p in walk.context..walk.context + walk.steps {
        let last = |states: &[f32]| states[(p - 1) * w..p * w].to_vec();
        if batched {
            let rows: Vec<Vec<f32>> = seqs.iter().map(|(_, states)| last(states)).collect();
            let mut jobs: Vec<BlockDraft<B>> = caches
                .iter_mut()
                .zip(seqs.iter().zip(&rows))
                .map(|(cache, ((tokens, _), row))| BlockDraft {
                    cache,
                    context: row,
                    pending: tokens[p],
                    pos: p,
                    k: walk.depth,
                })
                .collect();
            drafts.extend(drafter.draft_batched(&mut jobs)?.into_iter().map(bits));
        } else {
            for (c, (tokens, states)) in caches.iter_mut().zip(seqs) {
                drafter.extend_context(c, p - 1, &last(states))?;
                drafts.push(bits(drafter.draft(c, tokens[p], p, walk.depth)?));
            }
        }
    }
    Ok((drafts, t.elapsed().as_secs_f64()))
}

/// `steps` drafting steps of every sequence from position `context` on: each catches its head cache up on one
/// position and drafts `depth` tokens, then keeps the caught-up row (as after a cycle that kept no draft). In
/// one batched call per step or one chained draft per sequence: the drafts and the seconds taken.
fn head_steps<B: Backend>(
    head: &mut MtpHead<B>,
    seqs: &[(Vec<u32>, Vec<f32>)],
    walk: Walk,
    batched: bool,
) -> Result<(Vec<Vec<u32>>, f64)> {
    let h = head.hidden_size();
    // Head caches caught up on positions 1..context (slot i holds position i + 1).
    let mut caches = Vec::new();
    for (tokens, hidden) in seqs {
        let mut hc = head.new_cache(walk.context + walk.steps + walk.depth);
        head.draft_greedy(
            &mut hc,
            &tokens[1..walk.context],
            1,
            &hidden[..(walk.context - 1) * h],
            1,
        )?;
        caches.push(hc);
    }
    let mut drafts = Vec::new();
    let t = Instant::now();
    for p in walk.context..walk.context + walk.steps {
        let one = |i: usize| (&seqs[i].0[p..=p], &seqs[i].1[(p - 1) * h..p * h]);
        if batched {
            let mut jobs: Vec<HeadDraft<B>> = caches
                .iter_mut()
                .enumerate()
                .map(|(i, hc)| {
                    let (tok, hid) = one(i);
                    HeadDraft::new(hc, tok, p, hid, walk.depth)
                })
                .collect();
            drafts.extend(head.draft_greedy_batched(&mut jobs)?);
        } else {
            for (i, hc) in caches.iter_mut().enumerate() {
                let (tok, hid) = one(i);
                drafts.push(head.draft_greedy(hc, tok, p, hid, walk.depth)?);
            }
        }
        for hc in caches.iter_mut() {
            hc.truncate(p);
        }
    }
    Ok((drafts, t.elapsed().as_secs_f64()))
}

/// The batched arm and the one-per-sequence arm of `run(batched)` (what it decoded or drafted, and its seconds):
/// a warm-up run of each, then `repeat` of each, alternating which goes first. The median seconds of each, and
/// whether both always gave the same output.
fn interleaved<T: PartialEq>(
    repeat: usize,
    mut run: impl FnMut(bool) -> Result<(T, f64)>,
) -> Result<(f64, f64, bool)> {
    let (mut batched, mut sequential) = (Vec::new(), Vec::new());
    let mut identical = true;
    for rep in 0..repeat + 1 {
        let ((ob, sb), (os, ss)) = if rep % 2 == 0 {
            let b = run(true)?;
            (b, run(false)?)
        } else {
            let s = run(false)?;
            (run(true)?, s)
        };
        identical &= ob == os;
        if rep > 0 {
            batched.push(sb);
            sequential.push(ss);
        }
    }
    Ok((median(batched), median(sequential), identical))
}

/// The drafting arms for `n` sequences, interleaved as the decode arms are.
fn drafting<B: Backend>(
    model: &mut Model<B>,
    drafter: &mut Drafter<B>,
    a: &Args,
    n: usize,
) -> Result<Drafting> {
    let seqs = states(model, n, a.context + a.steps + 1, &drafter.features())?;
    let walk = Walk {
        context: a.context,
        steps: a.steps,
        depth: a.draft_depth,
    };
    let name = drafter.name();
    let (b, s, identical) = interleaved(a.repeat, |batched| match drafter {
        Drafter::Head(h) => head_steps(h, &seqs, walk, batched),
        Drafter::Block(d) => block_steps(d, &seqs, walk, batched),
    })?;
    let (b, s) = (1e3 * b / a.steps as f64, 1e3 * s / a.steps as f64);
    Ok(Drafting {
        model: name,
        depth: a.draft_depth,
        batched_ms: b,
        sequential_ms: s,
        speedup: s / b,
        identical,
    })
}

fn run<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    let path = crate::load::resolve(&a.model)?;
    let bundle = Bundle::open(&path)?;
    let mut model = Model::load(&bundle, backend)?;
    let mut drafter = match a.draft_depth {
        0 => None,
        d => {
            ensure!(
                d <= verity::model::MAX_CHAIN,
                "--draft-depth is at most {}",
                verity::model::MAX_CHAIN
            );
            ensure!(a.context >= 2, "--draft-depth needs --context of 2 or more");
            Some(Drafter::load(&bundle, &model)?)
        }
    };
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
        // Each run from freshly prefilled caches.
        let (b, s, identical) = interleaved(a.repeat, |batched| {
            let (mut caches, next) = prompts(&mut model, n, a.context)?;
            decode(&mut model, &mut caches, next, a.steps, batched)
        })?;
        let (b, s) = ((n * a.steps) as f64 / b, (n * a.steps) as f64 / s);
        println!("{n:>7} {b:>12.1} {s:>14.1} {:>7.2} {identical:>9}", b / s);
        let drafting = match drafter.as_mut() {
            Some(drafter) => {
                let d = drafting(&mut model, drafter, &a, n)?;
                println!(
                    "        {} drafting (depth {}): batched {:.3} ms/step, one per sequence {:.3} ms/step, \
                     {:.2}×, identical {}",
                    d.model, d.depth, d.batched_ms, d.sequential_ms, d.speedup, d.identical
                );
                Some(d)
            }
            None => None,
        };
        records.push(Record {
            streams: n,
            batched_tok_s: b,
            sequential_tok_s: s,
            ratio: b / s,
            identical,
            drafting,
        });
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&records)?)?;
    }
    Ok(())
}
