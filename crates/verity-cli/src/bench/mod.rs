//! `verity bench`: measurements written as JSON records, summarized as medians per route and category.

mod prompts;
mod speed;
mod summary;

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Decode speed per route and prompt category (see shared/bench/README.md for the record format).
    Speed(speed::Args),
}

pub fn main(c: Command, threads: usize) -> Result<()> {
    match c {
        Command::Speed(a) => speed::main(a, threads),
    }
}
