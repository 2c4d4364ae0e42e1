use std::sync::Arc;

use anyhow::{Context, Result};
use verity::backend::Backend;
use verity::speculative::SpecMode;
use verity_registry as registry;

use crate::device::{with_backend, Device, WithBackend};

#[derive(clap::Args)]
pub struct Args {
    /// A bundle path or a known model name.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait while one runs; more are answered 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// RAM for prefix-cache checkpoints of earlier conversations, in MiB (0 = off).
    #[arg(long, default_value_t = 512)]
    prefix_cache_mb: usize,
    /// Disk for persistent prefix-cache checkpoints, in MiB (0 = off), under `<cache folder>/prefix`.
    #[arg(long, default_value_t = 2048)]
    prefix_cache_disk_mb: u64,
    /// Speculative decoding: auto, off, copy, draft-model=PATH (requests may still ask for "off").
    #[arg(long, default_value = "auto")]
    speculation: SpecMode,
}

pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    with_backend(device, threads, a)
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        serve(self, backend)
    }
}

fn serve<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    let mut engine = crate::load::engine_on(&a.model, backend, &a.speculation)?;
    engine.set_prefix_cache_budget(a.prefix_cache_mb << 20);
    if a.prefix_cache_disk_mb > 0 {
        engine.set_prefix_cache_dir(&crate::cache::root()?, a.prefix_cache_disk_mb << 20);
    }
    let model_id = if registry::known(&a.model).is_some() {
        a.model.clone()
    } else {
        std::path::Path::new(&a.model)
            .file_stem()
            .map_or(a.model.clone(), |s| s.to_string_lossy().into_owned())
    };
    let router = verity_server::router(engine, &model_id, a.queue.max(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(verity_server::serve(
        router,
        &format!("{}:{}", a.host, a.port),
    ))
    .with_context(|| format!("serving on {}:{}", a.host, a.port))
}
