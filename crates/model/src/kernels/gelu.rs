//! GELU in its tanh form, as ggml computes it for the gated FFN of gemma: the input rounded to
//! f16 looks up a table of GELU values (themselves rounded to f16), inputs below -10 give 0 and
//! above 10 the input itself. Following ggml's table rather than evaluating tanh is what keeps
//! strata's activations next to llama.cpp's; it is also exact to compute the same way on every
//! row, whatever the batch.

use std::sync::OnceLock;

use half::f16;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// GELU(tanh) of `x` in f32 (the table's entries, before rounding).
pub fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// GELU of every f16 value, rounded to f16.
fn table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// GELU of one value, as ggml's table gives it.
#[inline]
fn gelu(t: &[f16], x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        t[f16::from_f32(x).to_bits() as usize].to_f32()
    }
}

/// `g[i] = gelu(g[i]) * u[i]`.
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    let t = table();
    for (a, &b) in g.iter_mut().zip(u) {
        *a = gelu(t, *a) * b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_follows_gelu_within_f16_rounding() {
        for i in -400..=400 {
            let x = i as f32 / 40.0;
            let mut g = [x];
            gelu_mul(&mut g, &[1.0]);
            let want = gelu_f32(x);
            assert!(
                (g[0] - want).abs() <= 2e-3 * want.abs().max(1.0),
                "gelu({x}) = {} vs {want}",
                g[0]
            );
        }
        let mut g = [-12.0, 12.0, 0.0];
        gelu_mul(&mut g, &[2.0, 2.0, 5.0]);
        assert_eq!(g, [0.0, 24.0, 0.0]);
    }
}
