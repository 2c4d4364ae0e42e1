//! Compiled kernels kept on disk between runs.
//!
//! NVRTC needs seconds to compile `kernels.cu` (27 s on the project's 2-core CPU machine), and a CUDA run
//! used to pay that at every start. The PTX of each (source, architecture, options, compiler version) is kept
//! in verity's cache folder under a name derived from all of them, and reused; the driver keeps its own cache
//! of the machine code it makes from PTX.
//!
//! Invariants:
//! - A file is used only if it holds exactly what it claims: a header with the PTX's length and checksum,
//!   then that PTX. A truncated or altered file is ignored and replaced by a fresh compilation.
//! - Nothing here can stop a run: without a cache folder, or when it cannot be written, every run compiles.
//! - Files are written to a temporary name and renamed, so a reader never sees half a file.
//! - The folder holds at most [`KEEP`] PTX files: each verity version, option set or toolkit writes its own
//!   (~4 MB for `kernels.cu`), so after a new one is written the least recently used past that many go (a
//!   file's use refreshes its modification time).
//!
//! The key and the checksum are 64-bit XXH3 (the hash the prefix cache's files use): they only need to tell
//! inputs and files apart, not resist an adversary.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &str = "verity-ptx";
/// PTX files kept in the cache folder.
pub const KEEP: usize = 8;

/// The hash of `parts`, each followed by a separator byte (so ("ab", "c") and ("a", "bc") differ; 0xff never
/// occurs in UTF-8).
pub fn key(parts: &[&str]) -> u64 {
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend_from_slice(p.as_bytes());
        bytes.push(0xff);
    }
    xxh3_64(&bytes)
}

fn checksum(ptx: &str) -> u64 {
    xxh3_64(ptx.as_bytes())
}

/// The file of `key` in `dir`.
pub fn path(dir: &Path, key: u64) -> PathBuf {
    dir.join("cuda").join(format!("kernels-{key:016x}.ptx"))
}

/// The PTX stored at `path`, if the file is whole.
pub fn read(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let (header, ptx) = text.split_once('\n')?;
    let mut fields = header.split(' ');
    let (magic, len, sum) = (fields.next()?, fields.next()?, fields.next()?);
    let whole = magic == MAGIC
        && fields.next().is_none()
        && len.parse::<usize>().ok()? == ptx.len()
        && u64::from_str_radix(sum, 16).ok()? == checksum(ptx);
    whole.then(|| ptx.to_string())
}

/// Store `ptx` at `path` (through a temporary file in the same folder).
pub fn write(path: &Path, ptx: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id()
    ));
    let header = format!("{MAGIC} {} {:016x}\n", ptx.len(), checksum(ptx));
    fs::write(&tmp, header + ptx)?;
    fs::rename(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// The PTX of `key`: from `dir`'s cache when a whole file is there (`true`), else from `compile` (`false`),
/// which is then stored for the next run (a failure to store is logged, never returned).
pub fn get_or_compile<E>(
    dir: Option<&Path>,
    key: u64,
    compile: impl FnOnce() -> Result<String, E>,
) -> Result<(String, bool), E> {
    let file = dir.map(|d| path(d, key));
    if let Some(ptx) = file.as_deref().and_then(read) {
        touch(file.as_deref().expect("read from a file"));
        return Ok((ptx, true));
    }
    let ptx = compile()?;
    if let Some(file) = &file {
        match write(file, &ptx) {
            Ok(()) => prune(file.parent().unwrap_or(Path::new(".")), KEEP),
            Err(e) => tracing::warn!(
                "could not keep the compiled kernels in {}: {e}",
                file.display()
            ),
        }
    }
    Ok((ptx, false))
}

/// Mark `path` as just used (best effort: a read-only cache only loses the ordering).
fn touch(path: &Path) {
    let _ = fs::File::options()
        .append(true)
        .open(path)
        .and_then(|f| f.set_modified(SystemTime::now()));
}

/// Remove the PTX files of `dir` past the `keep` most recently used (best effort).
pub fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(SystemTime, PathBuf)> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name();
            let name = name.to_str()?;
            if !(name.starts_with("kernels-") && name.ends_with(".ptx")) {
                return None;
            }
            Some((e.metadata().ok()?.modified().ok()?, e.path()))
        })
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, old) in files.into_iter().skip(keep) {
        let _ = fs::remove_file(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("verity-ptx-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_run_reads_what_the_first_compiled() {
        let d = folder("reuse");
        let k = key(&["src", "compute_90", "-DX=1"]);
        let first = get_or_compile(Some(&d), k, || {
            Ok::<_, ()>(".version 8.0\n// kernels\n".to_string())
        });
        assert_eq!(first, Ok((".version 8.0\n// kernels\n".to_string(), false)));
        let second = get_or_compile(Some(&d), k, || -> Result<String, ()> {
            panic!("compiled again")
        });
        assert_eq!(second, Ok((".version 8.0\n// kernels\n".to_string(), true)));
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn every_input_of_the_compilation_changes_the_key() {
        let base = key(&["src", "compute_90", "-DX=1", "12.9"]);
        for other in [
            ["src2", "compute_90", "-DX=1", "12.9"],
            ["src", "compute_80", "-DX=1", "12.9"],
            ["src", "compute_90", "-DX=2", "12.9"],
            ["src", "compute_90", "-DX=1", "13.0"],
        ] {
            assert_ne!(key(&other), base, "{other:?}");
        }
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
    }

    #[test]
    fn a_truncated_or_altered_file_is_compiled_again_and_replaced() {
        let d = folder("damaged");
        let k = key(&["src"]);
        let ptx = ".version 8.0\n.target sm_90\n// a kernel\n".to_string();
        get_or_compile(Some(&d), k, || Ok::<_, ()>(ptx.clone())).unwrap();
        let file = path(&d, k);
        let whole = fs::read(&file).unwrap();
        for damaged in [
            whole[..whole.len() - 5].to_vec(), // truncated
            [&whole[..], b"extra"].concat(),   // grown
            String::from_utf8(whole.clone())
                .unwrap()
                .replace("a kernel", "b kernel")
                .into_bytes(), // altered
            b"not a cache file".to_vec(),
            Vec::new(),
        ] {
            fs::write(&file, &damaged).unwrap();
            assert_eq!(read(&file), None);
            let got = get_or_compile(Some(&d), k, || Ok::<_, ()>(ptx.clone())).unwrap();
            assert_eq!(got, (ptx.clone(), false));
            assert_eq!(
                read(&file).as_deref(),
                Some(ptx.as_str()),
                "replaced by the fresh compilation"
            );
        }
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_folder_keeps_only_the_most_recently_used_files() {
        let d = folder("prune");
        let t0 = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let stamp = |k: u64, secs: u64| {
            fs::File::options()
                .append(true)
                .open(path(&d, k))
                .unwrap()
                .set_modified(t0 + std::time::Duration::from_secs(secs))
                .unwrap();
        };
        for k in 0..KEEP as u64 {
            write(&path(&d, k), "ptx").unwrap();
            stamp(k, k);
        }
        fs::write(d.join("cuda").join("notes.txt"), "not ours").unwrap();
        // Key 0, the oldest, is used again: it becomes the newest.
        assert!(get_or_compile(Some(&d), 0, || Err("compiled")).unwrap().1);
        // A new compilation pushes the folder past KEEP: the least recently used (key 1) goes.
        get_or_compile(Some(&d), 100, || Ok::<_, ()>("ptx".to_string())).unwrap();
        let left = |k: u64| path(&d, k).exists();
        assert!(!left(1));
        assert!(left(0) && left(100) && (2..KEEP as u64).all(left));
        assert!(
            d.join("cuda").join("notes.txt").exists(),
            "other files are left alone"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn without_a_cache_folder_every_run_compiles_and_errors_pass_through() {
        let got = get_or_compile(None, 7, || Ok::<_, ()>("ptx".to_string()));
        assert_eq!(got, Ok(("ptx".to_string(), false)));
        let err = get_or_compile(None, 7, || Err::<String, _>("syntax error"));
        assert_eq!(err, Err("syntax error"));
    }

    #[test]
    fn an_unwritable_cache_folder_only_means_compiling() {
        let d = folder("blocked");
        fs::create_dir_all(d.parent().unwrap()).unwrap();
        fs::write(&d, b"a file where the folder should be").unwrap();
        for _ in 0..2 {
            let got = get_or_compile(Some(&d), 1, || Ok::<_, ()>("ptx".to_string()));
            assert_eq!(got, Ok(("ptx".to_string(), false)));
        }
        fs::remove_file(&d).unwrap();
    }
}
