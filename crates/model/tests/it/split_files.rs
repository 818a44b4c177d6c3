//! Models split into several files (`NAME-00001-of-00003.gguf`, llama.cpp's `gguf-split`
//! layout) load from their first part and give bitwise the logits of the single file; a
//! layer range loads from the parts that hold it even when the others are absent, and one
//! that needs an absent part is an error naming it.

use gguf::GgufFile;
use model::{Batch, LayerRange, Model, ModelOptions, Output};
use testkit::TinySpec;

fn opts() -> ModelOptions {
    ModelOptions {
        n_threads: 1,
        isa: None,
        kv_type: model::KvType::F16,
    }
}

fn logits_of(m: &Model, ids: &[u32]) -> Vec<f32> {
    let rows: Vec<model::Row> = ids
        .iter()
        .enumerate()
        .map(|(pos, &token)| model::Row {
            seq: 0,
            pos,
            token,
            want_logits: true,
        })
        .collect();
    let mut cache = m.new_cache(64);
    match m
        .forward(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap()
    {
        Output::Logits(l) => l,
        Output::Hidden(_) => panic!("a whole model gives logits"),
    }
}

#[test]
fn a_split_model_reads_as_the_single_file_and_a_range_needs_only_its_parts() {
    for tied_head in [false, true] {
        let spec = TinySpec {
            n_layers: 6,
            tied_head,
            ..TinySpec::default()
        };
        let bytes = testkit::tiny_model_bytes(&spec);
        let dir =
            std::env::temp_dir().join(format!("strata-split-{}-{tied_head}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = testkit::write_split(&bytes, &dir, "tiny", 3);
        let whole = GgufFile::from_bytes(bytes).unwrap();
        let split = GgufFile::open(&first).unwrap();
        assert_eq!(split.n_parts(), 3);
        assert_eq!(
            split.header().tensors().len(),
            whole.header().tensors().len()
        );
        let ids = [3, 17, 42, 99, 7, 250, 11];
        let want = logits_of(&Model::load(&whole, None, opts()).unwrap(), &ids);
        let got = logits_of(&Model::load(&split, None, opts()).unwrap(), &ids);
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "tied {tied_head}: the split model's logits differ"
        );

        // Opening another part than the first names the first.
        let second = dir.join("tiny-00002-of-00003.gguf");
        let e = GgufFile::open(&second).unwrap_err().to_string();
        assert!(e.contains("tiny-00001-of-00003.gguf"), "{e}");

        // The last part gone: the first layers load (their tensors are in parts 1 and 2),
        // the last ones are refused, naming the absent part.
        std::fs::remove_file(dir.join("tiny-00003-of-00003.gguf")).unwrap();
        let partial = GgufFile::open(&first).unwrap();
        assert_eq!(partial.absent_parts(), ["tiny-00003-of-00003.gguf"]);
        let front = Model::load(&partial, Some(LayerRange { start: 0, end: 2 }), opts());
        assert!(
            front.is_ok(),
            "tied {tied_head}: {:?}",
            front.err().map(|e| e.to_string())
        );
        let back = Model::load(&partial, Some(LayerRange { start: 4, end: 6 }), opts());
        let e = back.err().expect("a range in the absent part").to_string();
        assert!(
            e.contains("tiny-00003-of-00003.gguf"),
            "tied {tied_head}: {e}"
        );

        // A part that says it is another part is refused.
        let bad_dir = dir.join("bad");
        let again = testkit::write_split(&testkit::tiny_model_bytes(&spec), &bad_dir, "tiny", 3);
        std::fs::copy(
            bad_dir.join("tiny-00003-of-00003.gguf"),
            bad_dir.join("tiny-00002-of-00003.gguf"),
        )
        .unwrap();
        let e = GgufFile::open(&again).unwrap_err().to_string();
        assert!(e.contains("split.no"), "{e}");
    }
}
