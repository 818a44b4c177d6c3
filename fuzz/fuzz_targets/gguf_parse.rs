//! Fuzzes the GGUF header parser and the reference block codecs with arbitrary bytes: any input
//! must give `Ok` or a typed error, never a panic, hang or huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = gguf::parse(data) {
        for t in h.tensors() {
            let start = (h.data_offset + t.offset) as usize;
            let bytes = &data[start..start + t.n_bytes as usize];
            // Decode the first row only, to keep each run fast.
            let row = t.shape[0] as usize;
            if row <= 1 << 16 {
                let mut out = vec![0f32; row];
                let _ = gguf::quant::dequantize(t.ty, &bytes[..t.ty.row_bytes(row)], &mut out);
            }
        }
    }
});
