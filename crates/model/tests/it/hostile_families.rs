//! A model file that is corrupt or outside what strata runs fails to load with a typed error
//! naming what is wrong (the architecture, a missing tensor, a wrong shape, a RoPE type, a
//! sliding window), never a panic.

use gguf::{GgufFile, Value, Writer};
use model::{Error, Model, ModelOptions};
use testkit::TinySpec;

/// `spec`'s model rewritten: `meta` changes its metadata (a value, or `None` to drop the key),
/// `tensor` its tensors (a new shape, or `None` to drop one).
fn edited(
    spec: &TinySpec,
    meta: &[(&str, Option<Value>)],
    tensor: &[(&str, Option<Vec<u64>>)],
) -> GgufFile {
    let f = GgufFile::from_bytes(testkit::tiny_model_bytes(spec)).unwrap();
    let mut w = Writer::new(3);
    for (k, v) in f.header().metadata() {
        match meta.iter().find(|(name, _)| name == k) {
            Some((_, Some(new))) => w.metadata(k, new.clone()),
            Some((_, None)) => &mut w,
            None => w.metadata(k, v.clone()),
        };
    }
    for (k, v) in meta {
        if f.header().get(k).is_none() {
            if let Some(v) = v {
                w.metadata(k, v.clone());
            }
        }
    }
    for info in f.header().tensors() {
        let data = f.data(info).to_vec();
        match tensor.iter().find(|(name, _)| *name == info.name) {
            Some((_, None)) => {}
            Some((_, Some(shape))) => {
                // Keep the byte count consistent with the new shape (the rest is the loader's
                // business): a wrong shape with the right size of data.
                let n: u64 = shape.iter().product();
                let bytes = info.ty.row_bytes(n as usize);
                let mut d = data;
                d.resize(bytes, 0);
                w.tensor(&info.name, shape, info.ty, d);
            }
            None => {
                w.tensor(&info.name, &info.shape, info.ty, data);
            }
        }
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

fn load(f: &GgufFile) -> Result<Model, Error> {
    Model::load(
        f,
        None,
        ModelOptions {
            n_threads: 1,
            isa: None,
            kv_type: model::KvType::F16,
        },
    )
}

fn gemma() -> TinySpec {
    TinySpec {
        arch: "gemma3",
        head_dim: Some(128),
        n_layers: 6,
        ..TinySpec::default()
    }
}

#[test]
fn an_unknown_architecture_is_named_with_the_supported_ones() {
    let f = edited(
        &TinySpec::default(),
        &[("general.architecture", Some(Value::String("mamba".into())))],
        &[],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(
        e.contains("`mamba`") && e.contains("gemma3") && e.contains("qwen2"),
        "{e}"
    );
}

#[test]
fn a_missing_optional_tensor_of_the_family_is_named() {
    for (spec, name) in [
        (gemma(), "blk.3.post_ffw_norm.weight"),
        (gemma(), "blk.0.attn_q_norm.weight"),
        (
            TinySpec {
                arch: "qwen2",
                ..TinySpec::default()
            },
            "blk.1.attn_v.bias",
        ),
    ] {
        let f = edited(&spec, &[], &[(name, None)]);
        let e = load(&f).err().unwrap().to_string();
        assert!(e.contains(name), "{}: {e}", spec.arch);
    }
}

#[test]
fn a_wrong_shape_names_the_tensor_and_both_shapes() {
    let f = edited(
        &gemma(),
        &[],
        &[("blk.2.attn_k_norm.weight", Some(vec![64]))],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(
        e.contains("blk.2.attn_k_norm.weight") && e.contains("[64]") && e.contains("[128]"),
        "{e}"
    );
}

#[test]
fn unsupported_rope_scaling_and_bad_sizes_name_the_field() {
    let f = edited(
        &TinySpec {
            arch: "qwen2",
            ..TinySpec::default()
        },
        &[(
            "qwen2.rope.scaling.type",
            Some(Value::String("yarn".into())),
        )],
        &[],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(e.contains("rope.scaling.type") && e.contains("yarn"), "{e}");
    let f = edited(
        &gemma(),
        &[("gemma3.attention.sliding_window", Some(Value::U32(0)))],
        &[],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(e.contains("sliding_window"), "{e}");
    let f = edited(&gemma(), &[("gemma3.attention.sliding_window", None)], &[]);
    let e = load(&f).err().unwrap().to_string();
    assert!(e.contains("gemma3.attention.sliding_window"), "{e}");
    let f = edited(
        &gemma(),
        &[("gemma3.attention.value_length", Some(Value::U32(64)))],
        &[],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(e.contains("value_length"), "{e}");
    let f = edited(
        &gemma(),
        &[("gemma3.attention.head_count_kv", Some(Value::U32(3)))],
        &[],
    );
    let e = load(&f).err().unwrap().to_string();
    assert!(e.contains("head_count_kv"), "{e}");
}

/// The embedding of a first range with an untied head is read from the file as tokens come: a
/// file cut short while it is served makes a step an error naming the file, not a panic, and so
/// does a file rewritten in place with bytes of the same length (they are no longer the bytes
/// the model was loaded from).
#[test]
fn a_model_file_cut_short_while_served_fails_the_step_with_a_named_error() {
    use model::{Batch, Row};
    let spec = TinySpec {
        tied_head: false,
        ..TinySpec::default()
    };
    let path = testkit::write_tiny_model(&spec, "cut-short-while-served");
    // A copy of its own, since the tiny model's file is shared by name with other tests.
    let own = path.with_file_name("cut-short-while-served-own.gguf");
    std::fs::copy(&path, &own).unwrap();
    let m = load(&GgufFile::open(&own).unwrap()).unwrap();
    assert!(m.in_file_weight_bytes() > 0);
    let step = |token: u32| {
        let rows = [Row {
            seq: 0,
            pos: 0,
            token,
            want_logits: true,
        }];
        let mut cache = m.new_cache(4);
        m.forward(
            Batch {
                rows: &rows,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .map(|_| ())
    };
    step(5).unwrap();
    let whole = std::fs::read(&own).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&own)
        .unwrap()
        .set_len(64)
        .unwrap();
    let err = step(5).unwrap_err().to_string();
    assert!(err.contains("cut-short-while-served-own.gguf"), "{err}");
    assert!(err.contains("changed since it was loaded"), "{err}");
    std::fs::write(&own, &whole).unwrap();
    let err = step(5).unwrap_err().to_string();
    assert!(err.contains("changed since it was loaded"), "{err}");
    // Loaded again, it runs.
    let m = load(&GgufFile::open(&own).unwrap()).unwrap();
    assert!(m.in_file_weight_bytes() > 0);
    std::fs::remove_file(&own).unwrap();
}
