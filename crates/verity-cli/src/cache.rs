//! `verity cache ls|clear`: the prefix cache's disk tier of a model.

use anyhow::{Context, Result};
use verity::speculative::SpecMode;
use verity_registry as registry;

#[derive(clap::Subcommand)]
pub enum Command {
    /// List the stored checkpoints of a model.
    Ls(Args),
    /// Delete the stored checkpoints of a model.
    Clear(Args),
}

#[derive(clap::Args)]
pub struct Args {
    /// A bundle path or a known model name.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    model: String,
}

/// The disk tier's root: `<verity cache folder>/prefix`.
pub fn root() -> Result<std::path::PathBuf> {
    Ok(verity::storage::cache_dir()?.join("prefix"))
}

pub fn main(c: Command, threads: usize) -> Result<()> {
    let (Command::Ls(a) | Command::Clear(a)) = &c;
    let mut engine = crate::load::engine(&a.model, threads, &SpecMode::Off)?;
    let root = root()?;
    if !engine.set_prefix_cache_dir(&root, u64::MAX) {
        anyhow::bail!("cannot use the prefix cache folder {}", root.display());
    }
    let (dir, entries) = {
        let disk = engine.prefix_disk().context("disk tier")?;
        (disk.dir().to_path_buf(), disk.list())
    };
    match c {
        Command::Ls(_) => {
            println!("{}", dir.display());
            for (tokens, bytes, path) in &entries {
                println!(
                    "{tokens:>8} tokens {:>10.1} MB  {}",
                    *bytes as f64 / 1e6,
                    path.display()
                );
            }
            let total: u64 = entries.iter().map(|e| e.1).sum();
            println!(
                "{} checkpoints, {:.1} MB",
                entries.len(),
                total as f64 / 1e6
            );
        }
        Command::Clear(_) => {
            engine.clear_prefix_cache();
            println!(
                "removed {} checkpoints from {}",
                entries.len(),
                root.display()
            );
        }
    }
    Ok(())
}
