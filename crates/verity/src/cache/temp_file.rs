//! The temporary files of the disk tier's stores: a store writes one and renames it into place. What must hold:
//! no error path of a store leaves its temporary file behind (it is removed when dropped unless renamed), and
//! one left by a process that died is recognised as such whatever its age, while a store in progress in a live
//! process is left alone. Files are created private to their owner (0600).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

/// Where a process's liveness cannot be asked, a temporary file older than this is taken for a store whose
/// process died (a store takes milliseconds to seconds); younger ones may be another process's store in progress.
const STALE_STORE: std::time::Duration = std::time::Duration::from_secs(600);
pub(super) const TEMP_PREFIX: &str = ".tmp-";

/// Names of the temporary files this process is writing now (any tier; names are unique in a process): at
/// open, a temporary file named with this process's id but not listed here was left by an earlier process that
/// had the same id (containers reuse ids).
fn stores_in_progress() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A store's temporary file, private to the owner; removed when dropped unless it was renamed into place, so
/// that no error path of a store leaves it behind.
pub(super) struct TempFile {
    name: String,
    path: PathBuf,
    file: Option<File>,
}

impl TempFile {
    pub(super) fn create(dir: &Path, final_name: &str) -> std::io::Result<Self> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("{TEMP_PREFIX}{}-{seq}-{final_name}", std::process::id());
        let path = dir.join(&name);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        stores_in_progress().insert(name.clone());
        match options.open(&path) {
            Ok(file) => Ok(TempFile {
                name,
                path,
                file: Some(file),
            }),
            Err(e) => {
                stores_in_progress().remove(&name);
                Err(e)
            }
        }
    }

    pub(super) fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("open until persisted")
    }

    /// Rename into place; on failure the drop removes the temporary file.
    pub(super) fn persist(mut self, to: &Path) -> std::io::Result<()> {
        drop(self.file.take());
        std::fs::rename(&self.path, to)?;
        stores_in_progress().remove(&self.name);
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        drop(self.file.take());
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!("prefix cache: cannot remove {}: {e}", self.path.display());
        }
        stores_in_progress().remove(&self.name);
    }
}

/// The id of the process that writes a temporary file (from its name).
fn temp_owner(name: &str) -> Option<u32> {
    name.strip_prefix(TEMP_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Whether process `pid` exists, where the system can say.
fn process_exists(pid: u32) -> Option<bool> {
    #[cfg(target_os = "linux")]
    {
        if Path::new("/proc/self").exists() {
            return Some(Path::new("/proc").join(pid.to_string()).exists());
        }
    }
    let _ = pid;
    None
}

/// Whether a temporary file may still become a checkpoint: its store is in progress in this process, or in
/// another process that exists (or, where that cannot be asked, it is recent).
pub(super) fn temp_in_progress(name: &str, modified: Option<SystemTime>) -> bool {
    let owner = temp_owner(name);
    if owner == Some(std::process::id()) {
        return stores_in_progress().contains(name);
    }
    match owner.and_then(process_exists) {
        Some(exists) => exists,
        None => modified
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age <= STALE_STORE),
    }
}
