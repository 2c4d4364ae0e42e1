use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use verity::backend::Backend;
use verity::speculative::SpecMode;
use verity_registry as registry;
use verity_server::access::{Access, AccessConfig, Exposure};
use verity_server::limits::Limits;

use crate::device::{with_backend, Device, WithBackend};

#[derive(clap::Args)]
pub struct Args {
    /// A bundle path or a known model name.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    model: String,
    /// The address to listen on. Anything but loopback needs --api-key (or --allow-no-api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that decode together in batched steps (1: one at a time, each on its speculative route).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Requests in batched steps draft too, each with a proposer of its own on the route's drafter (an MTP head
    /// or block drafter, shared; copying from its own context where the route has a draft model). Off by
    /// default: on a small CPU a batch's rows cost about the same each, and the drafts cost more than they gave.
    #[arg(long)]
    batch_drafts: bool,
    /// Requests that may wait while a batch is full (or a constrained request runs); more are answered 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// KV cache the decoding requests may hold together, in MiB (0 = no limit): a request joins the batch only
    /// while the caches' size at the batch's prompts plus their token limits stays within it, and waits
    /// otherwise; a request that alone needs more is refused.
    #[arg(long, default_value_t = 0)]
    kv_budget_mb: usize,
    /// RAM for prefix-cache checkpoints of earlier conversations, in MiB (0 = off).
    #[arg(long, default_value_t = 512)]
    prefix_cache_mb: usize,
    /// Disk for persistent prefix-cache checkpoints, in MiB (0 = off), under `<cache folder>/prefix`.
    #[arg(long, default_value_t = 2048)]
    prefix_cache_disk_mb: u64,
    /// Speculative decoding: auto, off, copy, mtp, drafter, draft-model=PATH (requests may still ask for "off").
    #[arg(long, default_value = "auto")]
    speculation: SpecMode,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (default: $VERITY_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Listen on a non-loopback address without an API key (anyone who reaches it can use the server).
    #[arg(long)]
    allow_no_api_key: bool,
    /// A Host name to answer besides localhost, 127.0.0.1 and [::1] (repeatable); requests naming other hosts
    /// are refused (421), which stops DNS rebinding.
    #[arg(long = "allowed-host", value_name = "HOST")]
    allowed_hosts: Vec<String>,
    /// A web origin (scheme://host[:port]) whose pages may call the server, or * for any (repeatable).
    /// Requests from other origins are refused (403).
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// Seconds a request's head may take from its first byte (and a new connection to its first byte).
    #[arg(long, default_value_t = Limits::default().header_timeout.as_secs_f64())]
    header_timeout_s: f64,
    /// Seconds a request's body may take after its head.
    #[arg(long, default_value_t = Limits::default().body_timeout.as_secs_f64())]
    body_timeout_s: f64,
    /// Seconds a kept-alive connection may wait for its next request, and a response may make no progress to a
    /// client that does not read. Generation time is never limited.
    #[arg(long, default_value_t = Limits::default().idle_timeout.as_secs_f64())]
    idle_timeout_s: f64,
    /// Connections served at once; more are answered 503.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// On Ctrl-C or SIGTERM: seconds the generation in progress may take to finish before it is cancelled
    /// (new and queued requests are refused at once).
    #[arg(long, default_value_t = 10.0)]
    shutdown_grace_s: f64,
}

/// More connections than any file-descriptor limit allows.
const MAX_CONNECTIONS: usize = 1 << 20;

impl Args {
    fn limits(&self) -> Result<Limits> {
        let seconds = |v: f64, flag: &str| {
            if v.is_finite() && v > 0.0 && v <= 86_400.0 {
                Ok(Duration::from_secs_f64(v))
            } else {
                bail!("--{flag} must be a number of seconds in (0, 86400], not {v}")
            }
        };
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            bail!("--max-connections must be in [1, {MAX_CONNECTIONS}]");
        }
        Ok(Limits {
            header_timeout: seconds(self.header_timeout_s, "header-timeout-s")?,
            body_timeout: seconds(self.body_timeout_s, "body-timeout-s")?,
            idle_timeout: seconds(self.idle_timeout_s, "idle-timeout-s")?,
            max_connections: self.max_connections,
        })
    }

    /// The addresses to bind and who may use them, checked before the model loads.
    fn access(&self) -> Result<(Vec<SocketAddr>, Access)> {
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .with_context(|| format!("resolving --host {}", self.host))?
            .collect();
        let api_key = self.api_key.clone().or_else(|| {
            std::env::var("VERITY_API_KEY")
                .ok()
                .filter(|k| !k.is_empty())
        });
        let access = AccessConfig {
            api_key,
            allowed_hosts: self.allowed_hosts.clone(),
            cors_origins: self.cors_origins.clone(),
            allow_no_api_key: self.allow_no_api_key,
        }
        .resolve(&addrs)?;
        if access.exposure() == (Exposure::Network { keyed: false }) {
            eprintln!(
                "warning: listening on {} without an API key: anyone who can reach it can run generations and reset the cache",
                self.host
            );
        }
        Ok((addrs, access))
    }
}

pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    // Refuse a bad bind or limit before loading anything.
    let limits = a.limits()?;
    let (addrs, access) = a.access()?;
    let g = a.shutdown_grace_s;
    if !(g.is_finite() && (0.0..=86_400.0).contains(&g)) {
        bail!("--shutdown-grace-s must be a number of seconds in [0, 86400], not {g}");
    }
    let checked = Checked {
        args: a,
        limits,
        addrs,
        access,
        shutdown_grace: Duration::from_secs_f64(g),
    };
    with_backend(device, threads, checked)
}

/// The arguments with the server settings already validated.
struct Checked {
    args: Args,
    limits: Limits,
    addrs: Vec<SocketAddr>,
    access: Access,
    shutdown_grace: Duration,
}

impl WithBackend for Checked {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        serve(self, backend)
    }
}

fn serve<B: Backend>(c: Checked, backend: Arc<B>) -> Result<()> {
    let a = &c.args;
    let mut engine = crate::load::engine_on(&a.model, backend, &a.speculation)?;
    engine.set_prefix_cache_budget(a.prefix_cache_mb << 20);
    engine.set_batch_drafts(a.batch_drafts);
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
    let capacity = verity_server::Capacity {
        queue: a.queue.max(1),
        batch: a.batch.max(1),
        kv_budget: (a.kv_budget_mb > 0).then_some(a.kv_budget_mb << 20),
    };
    let app = verity_server::app(engine, &model_id, capacity);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(verity_server::serve(
        app,
        &c.addrs,
        c.limits,
        c.access,
        c.shutdown_grace,
    ))
    .with_context(|| format!("serving on {}:{}", a.host, a.port))
}
