//! `verity bench rowexact`: teacher-forced over real text, compare each verify row's logits (W rows in one
//! forward) with the 1-row AR step at the same position: bitwise equality, max |Δ|, argmax agreement.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::device::{Device, WithBackend};
use serde::Serialize;
use verity::backend::Backend;
use verity::bundle::Bundle;
use verity::chat::Tokenizer;
use verity::model::{Batch, LogitRows, Model};
use verity::sample::argmax;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = verity_registry::DEFAULT_MODEL)]
    model: String,
    /// Positions compared per width.
    #[arg(long, default_value_t = 96)]
    positions: usize,
    /// Prompt file whose texts are concatenated into the teacher-forced text.
    #[arg(long, default_value = "bench/prompts.jsonl")]
    prompts: PathBuf,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct WidthResult {
    w: usize,
    rows: usize,
    bitwise_equal_rows: usize,
    max_abs_diff: f32,
    argmax_agree: usize,
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        run(self, backend)
    }
}

fn run<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    let path = crate::load::resolve(&a.model)?;
    let bundle = Bundle::open(&path)?;
    let tokenizer = Tokenizer::from_bundle(&bundle)?;
    let mut model = Model::load(&bundle, backend)?;
    let text = std::fs::read_to_string(&a.prompts)
        .with_context(|| format!("reading {}", a.prompts.display()))?;
    let tokens = tokenizer.encode(&text, false)?;
    let prefix = 16;
    if tokens.len() < prefix + a.positions + 8 {
        bail!("{} gives only {} tokens", a.prompts.display(), tokens.len());
    }
    let vocab = model.hp.vocab;
    let span = &tokens[prefix..prefix + a.positions + 8];
    let mut cache = model.new_cache(prefix + span.len() + 8);
    model.forward(
        &mut cache,
        &Batch::causal(&tokens[..prefix], 0),
        LogitRows::None,
        &[],
    )?;
    // Each width starts again from the prefix: restored from a checkpoint, since a recurrent layer's state
    // cannot be rolled back past the latest forward (a truncation there would empty the cache).
    let start = cache.checkpoint(model.backend());
    let mut single = Vec::with_capacity(span.len() * vocab);
    for (i, &t) in span.iter().enumerate() {
        single.extend(
            model
                .forward(
                    &mut cache,
                    &Batch::causal(&[t], prefix + i),
                    LogitRows::All,
                    &[],
                )?
                .logits,
        );
    }
    let mut results = Vec::new();
    for w in 2..=16 {
        cache.restore(model.backend(), &start)?;
        let mut r = WidthResult {
            w,
            rows: 0,
            bitwise_equal_rows: 0,
            max_abs_diff: 0.0,
            argmax_agree: 0,
        };
        let mut pos = 0;
        while pos + w <= span.len() && r.rows < a.positions {
            let out = model.forward(
                &mut cache,
                &Batch::causal(&span[pos..pos + w], prefix + pos),
                LogitRows::All,
                &[],
            )?;
            for row in 0..w {
                let got = &out.logits[row * vocab..(row + 1) * vocab];
                let want = &single[(pos + row) * vocab..(pos + row + 1) * vocab];
                r.rows += 1;
                r.bitwise_equal_rows +=
                    got.iter()
                        .zip(want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()) as usize;
                r.max_abs_diff = got
                    .iter()
                    .zip(want)
                    .map(|(x, y)| (x - y).abs())
                    .fold(r.max_abs_diff, f32::max);
                r.argmax_agree += (argmax(got) == argmax(want)) as usize;
            }
            pos += w;
        }
        println!(
            "W={w}: {}/{} rows bitwise equal, max |Δ| {:.3e}, argmax agrees {}/{}",
            r.bitwise_equal_rows, r.rows, r.max_abs_diff, r.argmax_agree, r.rows
        );
        results.push(r);
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&results)?)?;
    }
    if results.iter().any(|r| r.bitwise_equal_rows != r.rows) {
        bail!("verify rows are not bitwise equal to the AR step");
    }
    Ok(())
}
