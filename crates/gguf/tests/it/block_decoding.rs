//! Dequantization checked against an independent decoder: `kquant_reference.json` holds random
//! blocks (scales pinned to sane values) and the values the `gguf` Python package (0.19,
//! `gguf.quants.dequantize`) decodes them to.

use gguf::{quant, GgmlType};
use serde_json::Value;

#[test]
fn every_block_format_decodes_like_the_python_reference() {
    let reference: Value = serde_json::from_str(include_str!("kquant_reference.json")).unwrap();
    for (name, ty) in [
        ("Q2_K", GgmlType::Q2K),
        ("Q3_K", GgmlType::Q3K),
        ("Q4_K", GgmlType::Q4K),
        ("Q5_K", GgmlType::Q5K),
        ("Q6_K", GgmlType::Q6K),
        ("Q5_0", GgmlType::Q5_0),
        ("Q5_1", GgmlType::Q5_1),
        ("BF16", GgmlType::BF16),
    ] {
        let case = &reference[name];
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0f32; want.len()];
        quant::dequantize(ty, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{name}[{i}]: {g} vs {w}"
            );
        }
    }
}
