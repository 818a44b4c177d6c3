//! A GGUF file is untrusted input: truncated, bit-flipped and oversized files must give the
//! documented errors, never a panic or a huge allocation.

use gguf::{parse, quant, Error, GgmlType, Value, ValueType, Writer};

fn sample(version: u32) -> Vec<u8> {
    let mut w = Writer::new(version);
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", Value::U32(2))
        .metadata("tokenizer.ggml.tokens", Value::strings(["a", "b", "c"]))
        .metadata(
            "some.floats",
            Value::Array(ValueType::F32, vec![Value::F32(1.5), Value::F32(-2.0)]),
        );
    let x: Vec<f32> = (0..64).map(|i| i as f32 / 7.0).collect();
    w.tensor(
        "t.q8",
        &[32, 2],
        GgmlType::Q8_0,
        quant::quantize(GgmlType::Q8_0, &x).unwrap(),
    );
    w.tensor(
        "t.f32",
        &[4],
        GgmlType::F32,
        quant::quantize(GgmlType::F32, &x[..4]).unwrap(),
    );
    w.to_bytes()
}

#[test]
fn writer_output_parses_back_for_v2_and_v3() {
    for version in [2, 3] {
        let bytes = sample(version);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.version, version);
        assert_eq!(h.str("general.architecture").unwrap(), "llama");
        assert_eq!(h.u64("llama.block_count").unwrap(), 2);
        assert_eq!(h.array("tokenizer.ggml.tokens").unwrap().len(), 3);
        let t = h.tensor("t.q8").unwrap();
        assert_eq!(
            (t.shape.clone(), t.ty, t.n_bytes),
            (vec![32, 2], GgmlType::Q8_0, 68)
        );
        assert_eq!(h.data_offset % 32, 0);
        let f = gguf::GgufFile::from_bytes(bytes).unwrap();
        let (_, data) = f.tensor("t.f32").unwrap();
        assert_eq!(
            f32::from_le_bytes(data[4..8].try_into().unwrap()),
            1.0 / 7.0
        );
    }
}

#[test]
fn every_truncation_is_a_clean_error() {
    let bytes = sample(3);
    for len in 0..bytes.len() {
        match parse(&bytes[..len]) {
            Err(
                Error::Truncated { .. }
                | Error::TensorOutOfBounds { .. }
                | Error::CountTooLarge { .. },
            ) => {}
            other => panic!("truncated to {len} bytes: unexpected {other:?}"),
        }
    }
}

#[test]
fn every_single_bit_flip_is_parsed_or_refused_without_panic() {
    let bytes = sample(3);
    let header_len = parse(&bytes).unwrap().data_offset as usize;
    for byte_idx in 0..header_len {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[byte_idx] ^= 1 << bit;
            // Either outcome is fine; what matters is no panic and no runaway allocation.
            let _ = parse(&b);
        }
    }
}

#[test]
fn oversized_counts_are_refused_before_allocation() {
    let mut bytes = sample(3);
    // tensor_count at offset 8, kv_count at 16.
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    match parse(&bytes) {
        Err(Error::CountTooLarge { field, count, .. }) => {
            assert_eq!(field, "metadata_kv_count");
            assert_eq!(count, u64::MAX);
        }
        other => panic!("unexpected {other:?}"),
    }
    let mut bytes = sample(3);
    bytes[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(parse(&bytes), Err(Error::CountTooLarge { .. })));
}

#[test]
fn oversized_array_length_is_refused() {
    let mut w = Writer::new(3);
    w.metadata("a", Value::strings(["x"]));
    let mut bytes = w.to_bytes();
    // header 24, key "a": 8 + 1, value type 4, element type 4, then the array length.
    let at = 24 + 9 + 4 + 4;
    bytes[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let err = parse(&bytes).unwrap_err();
    assert!(matches!(err, Error::CountTooLarge { .. }), "{err}");
    assert!(
        err.to_string().contains("metadata `a` (array length)"),
        "{err}"
    );
}

#[test]
fn bad_magic_version_and_type_are_named() {
    let mut bytes = sample(3);
    bytes[0] = b'X';
    assert!(matches!(parse(&bytes), Err(Error::BadMagic { .. })));

    let mut bytes = sample(3);
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let err = parse(&bytes).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unsupported GGUF version 1 (supported: 2 and 3)"
    );

    let mut w = Writer::new(3);
    w.tensor("weird", &[32], GgmlType::F32, vec![0; 128]);
    let mut bytes = w.to_bytes();
    // header 24, name 8 + 5, n_dims 4, dim 8, then the type id.
    let at = 24 + 13 + 4 + 8;
    bytes[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let err = parse(&bytes).unwrap_err();
    assert_eq!(err.to_string(), "tensor `weird` has unsupported type id 99");
}

#[test]
fn tensor_data_outside_the_file_is_refused() {
    let mut w = Writer::new(3);
    w.tensor("t", &[8], GgmlType::F32, vec![0; 32]);
    let mut bytes = w.to_bytes();
    let at = 24 + 9 + 4 + 8;
    // Make the shape huge: the data would run past the end.
    bytes[at - 8..at].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let err = parse(&bytes).unwrap_err();
    assert!(matches!(err, Error::TensorOutOfBounds { .. }), "{err}");
    let mut bytes = w.to_bytes();
    bytes[at - 8..at].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = parse(&bytes).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TensorOutOfBounds { .. } | Error::ShapeOverflow { .. }
        ),
        "{err}"
    );
}
