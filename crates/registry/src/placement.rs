//! Where a shard that places itself goes (`strata shard --layers auto`): from the live records
//! of its model, the layers no shard serves first, then the layers the fewest shards serve, as
//! many as its weights budget holds.

use std::ops::Range;

use crate::ShardRecord;

/// Per layer of a model of `n_layers` layers (the file `digest` names), how many live shards of
/// it that take new sessions (not draining) serve it. Records of other models, or whose range
/// does not fit `n_layers`, count for nothing.
pub fn coverage<'a>(
    records: impl IntoIterator<Item = &'a ShardRecord>,
    digest: &str,
    n_layers: u32,
) -> Vec<u32> {
    let mut cover = vec![0u32; n_layers as usize];
    for r in records {
        if r.digest != digest || r.n_layers != n_layers || r.draining || !r.plausible() {
            continue;
        }
        for c in &mut cover[r.layer_start as usize..r.layer_end as usize] {
            *c += 1;
        }
    }
    cover
}

/// The range a shard placing itself takes, given each layer's `coverage`: it starts at the
/// first of the least-served layers (the first layer no shard serves, when there is one) and
/// goes on over the following layers served as little, as far as `fits(start, end)` allows:
/// so it ends where the next layers are served more (where another shard's range starts, and
/// the ranges chain into a route) or where its budget ends. `None` when not even one layer
/// fits the budget, or the model has no layers.
pub fn place(coverage: &[u32], fits: impl Fn(usize, usize) -> bool) -> Option<Range<usize>> {
    let least = *coverage.iter().min()?;
    let start = coverage.iter().position(|&c| c == least)?;
    if !fits(start, start + 1) {
        return None;
    }
    let mut end = start + 1;
    while end < coverage.len() && coverage[end] == least && fits(start, end + 1) {
        end += 1;
    }
    Some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(address: &str, layers: Range<u32>, n_layers: u32, digest: &str) -> ShardRecord {
        ShardRecord {
            address: address.into(),
            instance: "1".into(),
            model: "m".into(),
            digest: digest.into(),
            layer_start: layers.start,
            layer_end: layers.end,
            n_layers,
            recipe: String::new(),
            kv_budget_bytes: 0,
            kv_free_bytes: 0,
            max_sessions: 1,
            sessions: 0,
            draining: false,
        }
    }

    /// Three shards that each hold 45% of a 24-layer model (10 layers) arrive one after
    /// another: the first takes 0..10, the second 10..20, the third the rest (a complete
    /// route); a fourth starts a second route at layer 0, and a fifth continues it.
    #[test]
    fn shards_fill_the_uncovered_layers_then_the_least_served() {
        let fits = |s: usize, e: usize| e - s <= 10;
        let mut records = Vec::new();
        let mut got = Vec::new();
        for i in 0..5 {
            let cover = coverage(&records, "d", 24);
            let r = place(&cover, fits).expect("a range");
            records.push(record(
                &format!("h{i}:1"),
                r.start as u32..r.end as u32,
                24,
                "d",
            ));
            got.push(r);
        }
        assert_eq!(got, [0..10, 10..20, 20..24, 0..10, 10..20]);
    }

    #[test]
    fn other_models_draining_and_impossible_records_count_for_nothing() {
        let mut draining = record("a:1", 0..4, 8, "d");
        draining.draining = true;
        let mut reversed = record("e:1", 0..1, 8, "d");
        (reversed.layer_start, reversed.layer_end) = (5, 3);
        let records = [
            record("b:1", 0..4, 8, "other"),
            record("c:1", 0..4, 9, "d"),
            draining,
            reversed,
            record("f:1", 2..6, 8, "d"),
        ];
        assert_eq!(coverage(&records, "d", 8), [0, 0, 1, 1, 1, 1, 0, 0]);
        // The first uncovered layer, as far as the layers stay uncovered.
        assert_eq!(place(&coverage(&records, "d", 8), |_, _| true), Some(0..2));
    }

    #[test]
    fn a_budget_that_holds_no_layer_places_nothing() {
        assert_eq!(place(&[0, 0, 0], |_, _| false), None);
        assert_eq!(place(&[], |_, _| true), None);
        // The budget's limit depends on where the range starts (the embedding, the head).
        let fits = |s: usize, e: usize| (e - s) + usize::from(s == 0) * 2 <= 3;
        assert_eq!(place(&[0, 0, 0, 0], fits), Some(0..1));
        assert_eq!(place(&[1, 0, 0, 0], fits), Some(1..4));
    }
}
