//! `verity bench`: measurements written as JSON records, summarized as medians per route and category, and
//! drawn as PNG plots on request.

mod batch;
mod conversation;
mod plot;
mod prompts;
mod rowcost;
mod rowexact;
mod speed;
mod summary;

use anyhow::Result;

use crate::device::{with_backend, Device};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Decode speed per route and prompt category (bench/README.md describes the records).
    Speed(speed::Args),
    /// Two-turn conversations with the prefix cache on and off.
    Conversation(conversation::Args),
    /// Milliseconds of one verify forward at W rows.
    Rowcost(rowcost::Args),
    /// Teacher-forced comparison of verify rows with AR steps (bitwise).
    Rowexact(rowexact::Args),
    /// Decode throughput of N sequences in batched forwards against one forward each (bitwise the same tokens).
    Batch(batch::Args),
    /// Redraw the PNG plots of saved `--json` records (speed, conversation or rowcost).
    Plot(plot::Args),
}

pub fn main(c: Command, device: Device, threads: usize) -> Result<()> {
    match c {
        Command::Speed(a) => with_backend(device, threads, a),
        Command::Conversation(a) => with_backend(device, threads, a),
        Command::Rowcost(a) => rowcost::main(a, device, threads),
        Command::Rowexact(a) => with_backend(device, threads, a),
        Command::Batch(a) => batch::main(a, device, threads),
        Command::Plot(a) => plot::main(a),
    }
}
