//! Resolving a `--model` argument (a path, or a known model fetched on first use) and loading it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use verity::backend::cpu::CpuBackend;
use verity::backend::Backend;
use verity::engine::Engine;
use verity::speculative::SpecMode;
use verity_registry as registry;

/// The path of a model argument, fetching a known model with a progress bar if needed.
pub fn resolve(model: &str) -> Result<PathBuf> {
    let bar = ProgressBar::hidden();
    let mut progress = |done: u64, total: u64| {
        if bar.is_hidden() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_length(total);
            bar.set_style(
                ProgressStyle::with_template("unpacking {bar:40} {bytes}/{total_bytes} ({eta})")
                    .expect("valid template"),
            );
        }
        bar.set_position(done);
    };
    let path = registry::resolve(model, &mut progress)?;
    bar.finish_and_clear();
    Ok(path)
}

pub fn engine(model: &str, threads: usize, mode: &SpecMode) -> Result<Engine<CpuBackend>> {
    engine_on(model, Arc::new(CpuBackend::new(threads)?), mode)
}

/// Load on an existing backend (several engines of one benchmark share it).
pub fn engine_on<B: Backend>(model: &str, backend: Arc<B>, mode: &SpecMode) -> Result<Engine<B>> {
    let path = resolve(model)?;
    Engine::load(&path, backend, mode).with_context(|| format!("loading {}", path.display()))
}
