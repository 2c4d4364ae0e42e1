//! `verity`: run, chat with, inspect, fetch and benchmark local models.

mod bench;
mod cache;
mod chat;
mod device;
mod fetch;
mod inspect;
mod load;
mod quantize;
mod run;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "verity",
    version,
    about = "Local LLM inference with lossless speculative decoding"
)]
struct Cli {
    /// CPU threads (0 = one per core).
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    /// The backend: auto (GPU 0 where this build has CUDA and the machine a usable GPU, else the CPU), cpu, or
    /// cuda (GPU 0; builds with `--features cuda`).
    #[arg(long, global = true, value_enum, default_value_t = device::Device::Auto)]
    device: device::Device,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a known model into the cache folder (idempotent).
    Fetch(fetch::Args),
    /// Answer one prompt, streaming the chat-templated answer to stdout.
    Run(run::Args),
    /// Interactive chat that keeps the conversation.
    Chat(chat::Args),
    /// Describe a bundle: architecture, sizes, quantization, template, special tokens.
    Inspect(inspect::Args),
    /// Write a quantized GGUF (llama.cpp's presets and blocks) from a GGUF of float weights.
    Quantize(quantize::Args),
    /// An OpenAI-compatible HTTP server.
    Serve(serve::Args),
    /// The prefix cache on disk: `ls`, `clear`.
    #[command(subcommand)]
    Cache(cache::Command),
    /// Benchmarks (JSON records and a summary table).
    #[command(subcommand)]
    Bench(bench::Command),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VERITY_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let (threads, dev) = (cli.threads, cli.device);
    let result = match cli.command {
        Command::Fetch(a) => fetch::main(a),
        Command::Run(a) => run::main(a, dev, threads),
        Command::Chat(a) => chat::main(a, dev, threads),
        Command::Inspect(a) => inspect::main(a),
        Command::Quantize(a) => quantize::main(a, threads),
        Command::Serve(a) => serve::main(a, dev, threads),
        Command::Cache(c) => device::cpu_only(dev, "cache").and_then(|_| cache::main(c, threads)),
        Command::Bench(c) => bench::main(c, dev, threads),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
