//! A small fork-join thread pool for kernels.
//!
//! Workers sleep on a condition variable when idle (shards share hosts, so an idle pool must not
//! burn CPU), after a short spin so back-to-back kernel calls in one forward pass do not pay a
//! futex wake-up each. The calling thread takes part in every job. Tasks are handed out through
//! an atomic counter; which thread runs a task never affects its result.
//!
//! A job ends when its tasks are done, not when every worker has looked at it: a worker the OS
//! has not scheduled yet (another process's threads may hold the cores) simply misses the job,
//! so the caller never waits a scheduler time slice for a thread that has nothing left to do.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

/// A task: `(task index, thread index)`; the caller is thread 0, workers 1.. .
type Task = dyn Fn(usize, usize) + Sync;

#[derive(Clone, Copy)]
struct JobRef {
    /// Erased borrow of the caller's closure; valid while `run` is blocked (see `run`).
    task: *const Task,
    n_tasks: usize,
}

// SAFETY: the pointee is `Sync` and outlives every use (the caller retires the job and waits for
// every worker that entered it before returning).
unsafe impl Send for JobRef {}

/// A value alone on its cache lines (two, as the adjacent-line prefetcher pairs them): the
/// counters every thread writes during a job must not share a line with each other or with
/// what idle workers spin on.
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

struct Shared {
    generation: Line<AtomicU64>,
    /// The current job; `None` once retired. Workers enter a job only under this lock.
    job: Mutex<Option<JobRef>>,
    wake: Condvar,
    /// The next task to claim: the one write per task that threads share.
    next_task: Line<AtomicUsize>,
    /// Tasks of the current job that have finished (or panicked), added by each thread once
    /// it finds no task left.
    n_done: Line<AtomicUsize>,
    /// Workers inside the current job.
    n_active: Line<AtomicUsize>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Set by [`ThreadPool::rest`]: idle workers sleep at once instead of spinning.
    resting: AtomicBool,
    /// Workers that have started running (see [`ThreadPool::new`]).
    n_started: AtomicUsize,
    /// The CPU the caller of the current job ran on when it published it (`usize::MAX` when
    /// unknown): a worker woken onto that CPU moves off it (see [`worker`]).
    caller_cpu: AtomicUsize,
    /// How many times a worker moved off its caller's CPU.
    n_moves: AtomicU64,
}

/// A pool of `n_threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    gate: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.n_threads())
    }
}

/// Spins on `done`, then yields, until it holds.
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 1 << 14 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

impl ThreadPool {
    pub fn new(n_threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            generation: Line(AtomicU64::new(0)),
            job: Mutex::new(None),
            wake: Condvar::new(),
            next_task: Line(AtomicUsize::new(0)),
            n_done: Line(AtomicUsize::new(0)),
            n_active: Line(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            resting: AtomicBool::new(false),
            n_started: AtomicUsize::new(0),
            caller_cpu: AtomicUsize::new(usize::MAX),
            n_moves: AtomicU64::new(0),
        });
        let workers = (1..n_threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("strata-kernel-{i}"))
                    .spawn(move || worker(&shared, i))
                    .expect("spawn kernel thread")
            })
            .collect::<Vec<_>>();
        // A new thread finishes starting (the runtime allocates its name, sets up its signal
        // stack) only when first scheduled, and a worker that never won a task could do that
        // during a later pass: a pool is ready once every worker is running.
        wait_until(|| shared.n_started.load(Ordering::Acquire) == workers.len());
        ThreadPool {
            shared,
            workers,
            gate: Mutex::new(()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// How many times a worker found itself on its caller's CPU and moved off it.
    pub fn n_moves(&self) -> u64 {
        self.shared.n_moves.load(Ordering::Relaxed)
    }

    /// Tells idle workers to sleep now rather than spin for the next job: called when a burst
    /// of jobs (a partial range's forward pass) ends, so the pool leaves the cores to whatever
    /// runs next (on a route, the next shard's pass on the same host).
    pub fn rest(&self) {
        self.shared.resting.store(true, Ordering::Relaxed);
    }

    /// Runs `task(i)` for every `i < n_tasks` across the pool and returns when all are done.
    pub fn run(&self, n_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        self.run_on(n_tasks, &|i, _| task(i));
    }

    /// `f(i)` for every `i < n`, spread over the pool in runs of consecutive indices (about
    /// four runs per thread), for per-row work too small to be a task each.
    pub fn run_rows(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let per_task = n.div_ceil(4 * self.n_threads()).max(1);
        self.run(n.div_ceil(per_task), &|task| {
            (task * per_task..((task + 1) * per_task).min(n)).for_each(f)
        });
    }

    /// [`ThreadPool::run`], also telling each task which thread runs it (`0` is the caller,
    /// workers are `1..n_threads`): a thread runs one task at a time, so per-thread buffers
    /// indexed by it are never shared.
    pub fn run_on(&self, n_tasks: usize, task: &(dyn Fn(usize, usize) + Sync)) {
        if self.workers.is_empty() || n_tasks <= 1 {
            (0..n_tasks).for_each(|i| task(i, 0));
            return;
        }
        let _gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call: the job is retired
        // (no worker can enter it) and every worker that entered has left before we return.
        let task_static: *const Task = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize, usize) + Sync + '_),
                *const (dyn Fn(usize, usize) + Sync + 'static),
            >(task)
        };
        s.resting.store(false, Ordering::Relaxed);
        s.caller_cpu
            .store(cpu::current().unwrap_or(usize::MAX), Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.n_done.store(0, Ordering::Relaxed);
        {
            let mut job = s.job.lock().unwrap_or_else(|e| e.into_inner());
            *job = Some(JobRef {
                task: task_static,
                n_tasks,
            });
            s.generation.fetch_add(1, Ordering::Release);
        }
        s.wake.notify_all();
        let mine = drain(s, task, n_tasks, 0);
        wait_until(|| s.n_done.load(Ordering::Acquire) == n_tasks);
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // Workers still inside found no task left; they are on their way out.
        wait_until(|| s.n_active.load(Ordering::Acquire) == 0);
        let panicked = s.panicked.swap(false, Ordering::Relaxed);
        if let Some(p) = mine {
            std::panic::resume_unwind(p);
        }
        if panicked {
            panic!("a kernel task panicked on a pool thread");
        }
    }
}

/// Claims and runs tasks until none is left, then counts them done (panicked or not, so the
/// job always ends); returns the first panic of this thread's tasks.
fn drain(
    s: &Shared,
    task: &(dyn Fn(usize, usize) + Sync + '_),
    n_tasks: usize,
    thread: usize,
) -> Option<Box<dyn Any + Send>> {
    let (mut first, mut ran) = (None, 0);
    loop {
        let i = s.next_task.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            s.n_done.fetch_add(ran, Ordering::Release);
            return first;
        }
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| task(i, thread))) {
            s.panicked.store(true, Ordering::Relaxed);
            first.get_or_insert(p);
        }
        ran += 1;
    }
}

fn worker(s: &Shared, thread: usize) {
    s.n_started.fetch_add(1, Ordering::Release);
    let mut seen = 0u64;
    loop {
        // Spin briefly for the next job, then sleep.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.generation.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256)
                && (start.elapsed() >= SPIN || s.resting.load(Ordering::Relaxed))
            {
                break;
            }
        }
        let job = {
            let mut job = s.job.lock().unwrap_or_else(|e| e.into_inner());
            while s.generation.load(Ordering::Acquire) == seen
                && !s.shutdown.load(Ordering::Relaxed)
            {
                job = s.wake.wait(job).unwrap_or_else(|e| e.into_inner());
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            seen = s.generation.load(Ordering::Acquire);
            // Entering under the lock: the caller retires the job under it, then waits for us.
            if job.is_some() {
                s.n_active.fetch_add(1, Ordering::Relaxed);
            }
            *job
        };
        if let Some(job) = job {
            // A worker woken onto the CPU its caller runs on preempts the caller, runs the
            // job alone, then spins for the next one while the caller that would publish it
            // waits for the CPU: a fork-join pair sharing one core is slower than one thread.
            // The scheduler keeps such a pair together once it placed them so (both threads
            // last ran there, and with a busy last-level cache it does not look for an idle
            // core), so the worker moves itself to another of its allowed CPUs.
            if let Some(c) = cpu::current() {
                if c == s.caller_cpu.load(Ordering::Relaxed) && cpu::move_off(c) {
                    s.n_moves.fetch_add(1, Ordering::Relaxed);
                }
            }
            // SAFETY: see `ThreadPool::run`: the closure outlives this use.
            let task = unsafe { &*job.task };
            drop(drain(s, task, job.n_tasks, thread));
            s.n_active.fetch_sub(1, Ordering::Release);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _job = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.shutdown.store(true, Ordering::Relaxed);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Which CPU a thread runs on, and moving it (Linux; elsewhere nothing is known or moved).
mod cpu {
    #[cfg(target_os = "linux")]
    pub fn current() -> Option<usize> {
        // SAFETY: no arguments; returns -1 on failure.
        let c = unsafe { libc::sched_getcpu() };
        usize::try_from(c).ok()
    }

    /// Moves the calling thread off `cpu` to another CPU it is allowed on, keeping its allowed
    /// set as it was; false if it has no other.
    #[cfg(target_os = "linux")]
    pub fn move_off(cpu: usize) -> bool {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `cpu_set_t` is plain data (all zeros is the empty set); the calls get its
        // size, and `CPU_*` index within it (`cpu` is below `CPU_SETSIZE`: it came from
        // `sched_getcpu` and was found set in the mask).
        unsafe {
            let mut allowed: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size, &mut allowed) != 0
                || cpu >= libc::CPU_SETSIZE as usize
                || !libc::CPU_ISSET(cpu, &allowed)
                || libc::CPU_COUNT(&allowed) < 2
            {
                return false;
            }
            let mut others = allowed;
            libc::CPU_CLR(cpu, &mut others);
            // The kernel migrates a thread off a CPU it is no longer allowed on before the
            // call returns; restoring the set then leaves it where it is.
            if libc::sched_setaffinity(0, size, &others) != 0 {
                return false;
            }
            libc::sched_setaffinity(0, size, &allowed);
            true
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub fn current() -> Option<usize> {
        None
    }

    #[cfg(not(target_os = "linux"))]
    pub fn move_off(_cpu: usize) -> bool {
        false
    }
}

/// A raw pointer to a caller's output buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(*mut T);

// SAFETY: tasks only write disjoint index sets (each user documents its partition).
unsafe impl<T: Send> Sync for SharedMut<T> {}
unsafe impl<T: Send> Send for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(slice: &mut [T]) -> Self {
        SharedMut(slice.as_mut_ptr())
    }

    /// # Safety
    /// `idx` must be in bounds of the original slice, and no other task may touch it.
    #[inline]
    pub unsafe fn write(&self, idx: usize, value: T) {
        // SAFETY: per the contract above.
        unsafe { self.0.add(idx).write(value) }
    }

    /// The address of element `idx`, for a kernel that writes a strided region (its own
    /// contract then says which elements it may touch).
    #[inline]
    pub fn at(&self, idx: usize) -> *mut T {
        self.0.wrapping_add(idx)
    }

    /// # Safety
    /// `[start, start + len)` must be in bounds and touched by no other task.
    #[inline]
    #[allow(clippy::mut_from_ref)] // reason: the pointer is shared by design; callers own disjoint parts
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: per the contract above.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 2, 7, 100] {
            let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_moved_off_its_cpu_runs_elsewhere_and_keeps_its_allowed_set() {
        let affinity = || {
            // SAFETY: plain data filled by the call.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                assert_eq!(
                    libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                    0
                );
                (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect::<Vec<_>>()
            }
        };
        std::thread::spawn(move || {
            let allowed = affinity();
            let here = cpu::current().expect("sched_getcpu works on Linux");
            if allowed.len() < 2 {
                // Nowhere else to go: nothing moves.
                assert!(!cpu::move_off(here));
                assert_eq!(cpu::current(), Some(here));
                return;
            }
            assert!(cpu::move_off(here));
            let now = cpu::current().unwrap();
            assert_ne!(now, here, "still on CPU {here}");
            assert!(allowed.contains(&now));
            assert_eq!(affinity(), allowed);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "boom"))
        }));
        assert!(r.is_err());
        let sum = AtomicUsize::new(0);
        pool.run(4, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 6);
    }
}
