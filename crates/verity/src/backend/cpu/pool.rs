//! A persistent worker pool for the per-operation parallelism of a forward.
//!
//! Why not rayon: a decode step runs a few hundred short operations (tens of microseconds each); waking sleeping
//! workers through futexes for every one of them costs as much as the work. Here workers spin on an epoch counter
//! for a while after each job (a decode step's operations arrive back to back), and only then sleep on a condvar.
//! Each job is split statically: worker `i` of `n` takes the `i`-th share, so results never depend on timing.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    epoch: AtomicU64,
    job: UnsafeCell<Option<Job>>,
    remaining: AtomicUsize,
    sleeping: AtomicUsize,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller of `run` while no worker reads it (all workers finished the
// previous epoch), and read by workers only after they observe the new epoch (Acquire after the Release bump).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serializes callers: one job at a time.
    calls: Mutex<()>,
}

impl Pool {
    /// A pool of `threads` threads in all: the caller plus `threads - 1` workers.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = shared.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("verity-cpu-{i}"))
                    .spawn(move || worker(s, i))?,
            );
        }
        Ok(Pool {
            shared,
            workers,
            threads,
            calls: Mutex::new(()),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f(i)` for every thread index `i < threads()`, `f(0)` on the calling thread; return when all are done.
    /// `f` must not call `run` itself.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            f(0);
            return;
        }
        let _serial = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: all workers finished the previous job (remaining reached 0 before the last `run` returned), so
        // none reads `job` now. The pointer outlives the job because this function waits for every worker.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *s.job.get() = Some(job);
        }
        s.remaining.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        f(0);
        while s.remaining.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
    }
}

fn worker(s: Arc<Shared>, index: usize) {
    let mut seen = 0u64;
    loop {
        // Spin for a while, then sleep until the epoch moves.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && started.elapsed() > SPIN {
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                drop(g);
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: the job was published before the epoch bump we observed (SeqCst/Acquire).
        let job = unsafe { (*s.job.get()).expect("job set before the epoch moves") };
        // SAFETY: the caller of `run` keeps the closure alive until `remaining` reaches 0.
        unsafe { (*job)(index) };
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A raw output pointer shared by the tasks of one job, each writing its own disjoint part of the output.
pub struct SharedOut(*mut f32);

// SAFETY: tasks write disjoint elements (each kernel states its partition), and `run` returns only after all
// tasks are done, so the borrow the pointer came from outlives every write.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32]) -> Self {
        SharedOut(out.as_mut_ptr())
    }

    /// The address of element `i`.
    pub fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// The `i`-th of `n` contiguous shares of `0..len`, in units of `align` (share sizes differ by one unit at most).
pub fn share(len: usize, n: usize, i: usize, align: usize) -> std::ops::Range<usize> {
    let units = len.div_ceil(align);
    let (base, extra) = (units / n, units % n);
    let start = i * base + i.min(extra);
    let end = start + base + (i < extra) as usize;
    (start * align).min(len)..(end * align).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_per_job_across_many_jobs() {
        let pool = Pool::new(3).unwrap();
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..2000 {
            if round % 500 == 0 {
                std::thread::sleep(Duration::from_millis(2)); // let workers fall asleep sometimes
            }
            pool.run(&|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 2000));
    }

    #[test]
    fn shares_cover_the_range_exactly() {
        for len in [0, 1, 7, 64, 100, 577] {
            for n in 1..5 {
                let mut next = 0;
                for i in 0..n {
                    let r = share(len, n, i, 4);
                    assert_eq!(r.start, next.min(len));
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
