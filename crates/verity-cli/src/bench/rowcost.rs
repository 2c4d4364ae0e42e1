//! `verity bench rowcost`: milliseconds of one target forward of W rows in verify mode (logits for every row),
//! W = 1, 2, 4, 8, 16, at a realistic context length; medians after warm-up, widths interleaved per repeat.
//! `--logits greedy` times the verify a greedy request runs (each row's argmax taken on the device).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::device::{with_backend, Device, WithBackend};
use serde::{Deserialize, Serialize};
use verity::backend::Backend;
use verity::bundle::Bundle;
use verity::model::{Batch, LogitRows, Model};

use super::summary::median;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = verity_registry::DEFAULT_MODEL)]
    model: String,
    /// Tokens already in the cache when the verify runs.
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, default_value_t = 15)]
    repeat: usize,
    #[arg(long, default_value = "1,2,4,8,16")]
    widths: String,
    /// What each forward returns: every row's logits (`all`) or every row's argmax (`greedy`, what a greedy
    /// verify asks for).
    #[arg(long, value_enum, default_value_t = Returns::All)]
    logits: Returns,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw ms and ms(W)/ms(1) by width as DIR/rowcost.png (the folder is created).
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Returns {
    All,
    Greedy,
}

#[derive(Serialize)]
struct Floor {
    /// Bytes one decode step reads: every weight matrix once (the tied output reads the whole embedding).
    bytes_per_token: usize,
    /// Measured read bandwidth of this machine with the same thread count, GB/s.
    bandwidth_gb_s: f64,
    floor_ms: f64,
    /// ms(W=1) / floor_ms.
    w1_over_floor: f64,
}

/// Read bandwidth: `threads` threads each summing their share of a 1 GiB buffer (far larger than any cache),
/// best of 5 passes after the pages are touched.
fn read_bandwidth(threads: usize) -> f64 {
    let len = 1usize << 27; // u64 words = 1 GiB
    let buf: Vec<u64> = (0..len as u64).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(len.div_ceil(threads))
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (len * 8) as f64 / best / 1e9
}

/// One width's figures, as `--json` writes them under `widths`.
#[derive(Serialize, Deserialize)]
pub struct Cost {
    pub w: usize,
    pub median_ms: f64,
    pub ratio_to_w1: f64,
}

pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    with_backend(device, threads, RowCost { a, threads })
}

struct RowCost {
    a: Args,
    threads: usize,
}

impl WithBackend for RowCost {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, device: Device) -> Result<()> {
        run(self.a, backend, device, self.threads)
    }
}

fn run<B: Backend>(a: Args, backend: Arc<B>, device: Device, threads: usize) -> Result<()> {
    // The folder first, so that an unusable one fails before the measurement.
    let plot = a
        .plot
        .as_deref()
        .map(|dir| super::plot::png_path(dir, "rowcost"))
        .transpose()?;
    let path = crate::load::resolve(&a.model)?;
    let mut model = Model::load(&Bundle::open(&path)?, backend)?;
    let widths: Vec<usize> = a
        .widths
        .split(',')
        .map(|w| w.trim().parse())
        .collect::<Result<_, _>>()?;
    let vocab = model.hp.vocab as u32;
    // Deterministic, non-trivial token ids (never all zeros).
    let tokens: Vec<u32> = (0..a.context + 32)
        .map(|i| (i as u32 * 7919 + 13) % vocab)
        .collect();
    let mut cache = model.new_cache(a.context + 32);
    for chunk in tokens[..a.context].chunks(64) {
        let pos = cache.len();
        model.forward(&mut cache, &Batch::causal(chunk, pos), LogitRows::None, &[])?;
    }
    let returns = match a.logits {
        Returns::All => LogitRows::All,
        Returns::Greedy => LogitRows::Greedy,
    };
    let mut samples = vec![Vec::new(); widths.len()];
    for rep in 0..a.repeat + 2 {
        for (i, &w) in widths.iter().enumerate() {
            cache.truncate(a.context);
            let batch = Batch::causal(&tokens[a.context..a.context + w], a.context);
            let t = Instant::now();
            model.forward(&mut cache, &batch, returns, &[])?;
            if rep >= 2 {
                samples[i].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let base = median(samples[0].clone());
    let mut costs = Vec::new();
    println!("{:>4} {:>10} {:>8}", "W", "ms", "ratio");
    for (i, &w) in widths.iter().enumerate() {
        let ms = median(samples[i].clone());
        println!("{w:>4} {ms:>10.2} {:>8.2}", ms / base);
        costs.push(Cost {
            w,
            median_ms: ms,
            ratio_to_w1: ms / base,
        });
    }
    let bytes = model.weight_bytes();
    // The floor uses this machine's measured CPU read bandwidth; on a GPU the card's bandwidth is the floor
    // (about 3.3–4.3 TB/s on the H100/H200), which this command does not measure.
    let floor = (device == Device::Cpu).then(|| {
        let bw = read_bandwidth(if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        });
        let floor_ms = bytes as f64 / (bw * 1e9) * 1e3;
        println!(
            "floor: {:.1} MB per token at {:.1} GB/s = {:.2} ms; W=1 takes {:.2}x the floor",
            bytes as f64 / 1e6,
            bw,
            floor_ms,
            base / floor_ms
        );
        Floor {
            bytes_per_token: bytes,
            bandwidth_gb_s: bw,
            floor_ms,
            w1_over_floor: base / floor_ms,
        }
    });
    if let Some(p) = &a.json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&serde_json::json!({"widths": costs, "floor": floor}))?,
        )
        .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(path) = &plot {
        let label = format!("context {}", a.context);
        super::plot::rowcost(&[(label, costs)], &super::plot::model_title(&a.model), path)?;
        eprintln!("plot: {}", path.display());
    }
    Ok(())
}
