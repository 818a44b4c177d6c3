//! A warm decode step allocates nothing: the forward pass reuses its buffers, the matrix
//! products their quantized inputs, attention its per-thread scratch, the KV pool its blocks.
//! Measured with a counting global allocator over real decode steps of a tiny model.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use model::{Batch, KvType, LayerRange, Model, ModelOptions, Row};
use testkit::TinySpec;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_warm_batched_decode_step_allocates_nothing() {
    let path = testkit::write_tiny_model(&TinySpec::default(), "no-alloc");
    let file = gguf::GgufFile::open(&path).unwrap();
    // Four sessions run on the shared path; sixteen data-parallel (one lane per thread); K and
    // V as f16 and as q8_0 (rotated, through the same scratch).
    let (f16, q8) = (KvType::F16, KvType::Q8_0);
    for (range, threads, n_seq, kv_type) in [
        (None, 2, 4, f16),
        (Some(LayerRange { start: 0, end: 2 }), 2, 4, f16),
        (None, 1, 4, f16),
        (None, 2, 16, f16),
        (Some(LayerRange { start: 2, end: 4 }), 2, 16, f16),
        (None, 2, 4, q8),
        (None, 2, 16, q8),
    ] {
        let m = Model::load(
            &file,
            range,
            ModelOptions {
                n_threads: threads,
                isa: None,
                kv_type,
            },
        )
        .unwrap();
        let mut caches: Vec<_> = (0..n_seq).map(|_| m.new_cache(64)).collect();
        let mut out = Vec::new();
        let width = m.config().n_embd;
        let step = |pos: usize, caches: &mut Vec<model::KvCache>, out: &mut Vec<f32>| {
            let rows: Vec<Row> = (0..n_seq)
                .map(|seq| Row {
                    seq,
                    pos,
                    token: (7 + seq + pos) as u32,
                    want_logits: true,
                })
                .collect();
            let hidden = vec![0.25f32; n_seq * width];
            let mut refs: Vec<&mut model::KvCache> = caches.iter_mut().collect();
            let batch = Batch {
                rows: &rows,
                hidden: (!m.is_first()).then_some(hidden.as_slice()),
            };
            COUNTING.store(true, Ordering::SeqCst);
            m.forward_into(batch, &mut refs, out).unwrap();
            COUNTING.store(false, Ordering::SeqCst);
        };
        // Warm up (buffers, KV blocks, per-thread attention scratch), then measure.
        for pos in 0..8 {
            step(pos, &mut caches, &mut out);
        }
        ALLOCATIONS.store(0, Ordering::SeqCst);
        for pos in 8..14 {
            step(pos, &mut caches, &mut out);
        }
        assert_eq!(
            ALLOCATIONS.load(Ordering::SeqCst),
            0,
            "range {range:?}, {threads} threads, {n_seq} sessions, {} K and V: allocations during warm decode steps",
            kv_type.name()
        );
    }
}
