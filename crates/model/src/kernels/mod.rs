//! Dot-product kernels and their run-time selection.
//!
//! A [`Kernels`] value is chosen once (per model load) from the CPU's features and used for
//! every product, so all rows of every batch go through the same code: a row's result never
//! depends on which other rows share a call (batch invariance, DESIGN.md invariant 2).

pub mod act;
pub mod attn;
pub mod attn_q8;
pub mod exp;
pub mod gelu;
pub mod packed;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use gguf::GgmlType;

/// The instruction set a [`Kernels`] value uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Whether this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        matches!(
            (self, Isa::detect()),
            (Isa::Scalar, _)
                | (Isa::Avx2, Isa::Avx2 | Isa::Avx512Vnni)
                | (Isa::Avx512Vnni, Isa::Avx512Vnni)
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// The instruction set [`Isa::name`] calls `name`, if this CPU runs it; else an error
    /// naming what it may be.
    pub fn from_name(name: &str) -> Result<Isa, String> {
        let isa = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .find(|i| i.name() == name)
            .ok_or_else(|| {
                format!("unknown isa `{name}` (expected scalar, avx2 or avx512-vnni)")
            })?;
        if !isa.is_supported() {
            return Err(format!(
                "isa `{name}` is not on this CPU (the best here is {})",
                Isa::detect().name()
            ));
        }
        Ok(isa)
    }

    /// For a test of this instruction set's kernels: whether the CPU has it. When it does not,
    /// the test says so in its output (it is tested on the machines that have it) instead of
    /// passing in silence.
    #[cfg(test)]
    pub(crate) fn testable(self, test: &str) -> bool {
        let ok = self.is_supported();
        if !ok {
            eprintln!(
                "{test}: {} not tested here (this CPU runs {})",
                self.name(),
                Isa::detect().name()
            );
        }
        ok
    }
}

type DotFn = fn(usize, &[u8], &[u8]) -> f32;
type Dot4Fn = fn(usize, &[u8], [&[u8]; 4]) -> [f32; 4];

/// How many activation rows the multi-row kernels take at once.
pub const ROWS: usize = 4;

/// The multi-row form of a single-row kernel, for types without a dedicated one: plain calls,
/// so results are trivially identical.
fn rows_of(dot: DotFn, n: usize, w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    a.map(|a| dot(n, w, a))
}

/// The dot products for one instruction set.
#[derive(Clone, Copy)]
pub struct Kernels {
    isa: Isa,
    q4_0: DotFn,
    q4_1: DotFn,
    q8_0: DotFn,
    q5_0: DotFn,
    q5_1: DotFn,
    q2k: DotFn,
    q3k: DotFn,
    q4k: DotFn,
    q5k: DotFn,
    q6k: DotFn,
    q4_0_x4: Dot4Fn,
    q4_1_x4: Dot4Fn,
    q8_0_x4: Dot4Fn,
    q5_0_x4: Dot4Fn,
    q5_1_x4: Dot4Fn,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernels({})", self.isa.name())
    }
}

impl Kernels {
    /// Kernels for `isa`, or `None` when this CPU lacks it.
    pub fn new(isa: Isa) -> Option<Kernels> {
        if !isa.is_supported() {
            return None;
        }
        Some(match isa {
            Isa::Scalar => Kernels {
                isa,
                q4_0: scalar::dot_q4_0_q8_0,
                q4_1: scalar::dot_q4_1_q8_1,
                q8_0: scalar::dot_q8_0_q8_0,
                q5_0: scalar::dot_q5_0_q8_0,
                q5_1: scalar::dot_q5_1_q8_1,
                q2k: scalar::dot_q2k_q8k,
                q3k: scalar::dot_q3k_q8k,
                q4k: scalar::dot_q4k_q8k,
                q5k: scalar::dot_q5k_q8k,
                q6k: scalar::dot_q6k_q8k,
                q4_0_x4: |n, w, a| rows_of(scalar::dot_q4_0_q8_0, n, w, a),
                q4_1_x4: |n, w, a| rows_of(scalar::dot_q4_1_q8_1, n, w, a),
                q8_0_x4: |n, w, a| rows_of(scalar::dot_q8_0_q8_0, n, w, a),
                q5_0_x4: |n, w, a| rows_of(scalar::dot_q5_0_q8_0, n, w, a),
                q5_1_x4: |n, w, a| rows_of(scalar::dot_q5_1_q8_1, n, w, a),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Kernels {
                isa,
                // SAFETY (all closures): `Isa::is_supported` confirmed the CPU features above.
                q4_0: |n, w, a| unsafe { x86::avx2::dot_q4_0_q8_0::<1>(n, w, [a])[0] },
                q4_1: |n, w, a| unsafe { x86::avx2::dot_q4_1_q8_1::<1>(n, w, [a])[0] },
                q8_0: |n, w, a| unsafe { x86::avx2::dot_q8_0_q8_0::<1>(n, w, [a])[0] },
                q4_0_x4: |n, w, a| unsafe { x86::avx2::dot_q4_0_q8_0::<4>(n, w, a) },
                q4_1_x4: |n, w, a| unsafe { x86::avx2::dot_q4_1_q8_1::<4>(n, w, a) },
                q8_0_x4: |n, w, a| unsafe { x86::avx2::dot_q8_0_q8_0::<4>(n, w, a) },
                q5_0: |n, w, a| unsafe { x86::avx2::dot_q5_0_q8_0::<1>(n, w, [a])[0] },
                q5_1: |n, w, a| unsafe { x86::avx2::dot_q5_1_q8_1::<1>(n, w, [a])[0] },
                q5_0_x4: |n, w, a| unsafe { x86::avx2::dot_q5_0_q8_0::<4>(n, w, a) },
                q5_1_x4: |n, w, a| unsafe { x86::avx2::dot_q5_1_q8_1::<4>(n, w, a) },
                q2k: |n, w, a| unsafe { x86::avx2::dot_q2k_q8k(n, w, a) },
                q3k: |n, w, a| unsafe { x86::avx2::dot_q3k_q8k(n, w, a) },
                q4k: |n, w, a| unsafe { x86::avx2::dot_q4k_q8k(n, w, a) },
                q5k: |n, w, a| unsafe { x86::avx2::dot_q5k_q8k(n, w, a) },
                q6k: |n, w, a| unsafe { x86::avx2::dot_q6k_q8k(n, w, a) },
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Kernels {
                isa,
                q4_0: |n, w, a| unsafe { x86::vnni::dot_q4_0_q8_0::<1>(n, w, [a])[0] },
                q4_1: |n, w, a| unsafe { x86::vnni::dot_q4_1_q8_1::<1>(n, w, [a])[0] },
                q8_0: |n, w, a| unsafe { x86::vnni::dot_q8_0_q8_0::<1>(n, w, [a])[0] },
                q4_0_x4: |n, w, a| unsafe { x86::vnni::dot_q4_0_q8_0::<4>(n, w, a) },
                q4_1_x4: |n, w, a| unsafe { x86::vnni::dot_q4_1_q8_1::<4>(n, w, a) },
                q8_0_x4: |n, w, a| unsafe { x86::vnni::dot_q8_0_q8_0::<4>(n, w, a) },
                q5_0: |n, w, a| unsafe { x86::vnni::dot_q5_0_q8_0::<1>(n, w, [a])[0] },
                q5_1: |n, w, a| unsafe { x86::vnni::dot_q5_1_q8_1::<1>(n, w, [a])[0] },
                q5_0_x4: |n, w, a| unsafe { x86::vnni::dot_q5_0_q8_0::<4>(n, w, a) },
                q5_1_x4: |n, w, a| unsafe { x86::vnni::dot_q5_1_q8_1::<4>(n, w, a) },
                q2k: |n, w, a| unsafe { x86::vnni::dot_q2k_q8k(n, w, a) },
                q3k: |n, w, a| unsafe { x86::vnni::dot_q3k_q8k(n, w, a) },
                q4k: |n, w, a| unsafe { x86::vnni::dot_q4k_q8k(n, w, a) },
                q5k: |n, w, a| unsafe { x86::vnni::dot_q5k_q8k(n, w, a) },
                q6k: |n, w, a| unsafe { x86::vnni::dot_q6k_q8k(n, w, a) },
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => return None,
        })
    }

    /// The best kernels for this CPU.
    pub fn detect() -> Kernels {
        Kernels::new(Isa::detect()).expect("detected isa is supported")
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Dot product of one weight row (`n` values of `ty`) with one activation row quantized as
    /// [`act::act_type`]`(ty)`. `scratch` is used only by the dequantizing fallback (types
    /// without an integer kernel: F32, F16, BF16).
    #[inline]
    pub fn dot(&self, ty: GgmlType, n: usize, w: &[u8], a: &[u8], scratch: &mut Vec<f32>) -> f32 {
        match ty {
            GgmlType::Q4_0 => (self.q4_0)(n, w, a),
            GgmlType::Q4_1 => (self.q4_1)(n, w, a),
            GgmlType::Q8_0 => (self.q8_0)(n, w, a),
            GgmlType::Q2K => (self.q2k)(n, w, a),
            GgmlType::Q3K => (self.q3k)(n, w, a),
            GgmlType::Q4K => (self.q4k)(n, w, a),
            GgmlType::Q5K => (self.q5k)(n, w, a),
            GgmlType::Q6K => (self.q6k)(n, w, a),
            GgmlType::Q5_0 => (self.q5_0)(n, w, a),
            GgmlType::Q5_1 => (self.q5_1)(n, w, a),
            _ => scalar::dot_dequant_f32(ty, n, w, a, scratch),
        }
    }
}

impl Kernels {
    /// One weight row against [`ROWS`] activation rows; bitwise equal to [`ROWS`] calls of
    /// [`Kernels::dot`].
    #[inline]
    pub fn dot4(
        &self,
        ty: GgmlType,
        n: usize,
        w: &[u8],
        a: [&[u8]; 4],
        scratch: &mut Vec<f32>,
    ) -> [f32; 4] {
        match ty {
            GgmlType::Q4_0 => (self.q4_0_x4)(n, w, a),
            GgmlType::Q4_1 => (self.q4_1_x4)(n, w, a),
            GgmlType::Q8_0 => (self.q8_0_x4)(n, w, a),
            GgmlType::Q5_0 => (self.q5_0_x4)(n, w, a),
            GgmlType::Q5_1 => (self.q5_1_x4)(n, w, a),
            _ => a.map(|a| self.dot(ty, n, w, a, scratch)),
        }
    }
}

impl Kernels {
    /// `q . k` over an f16 row, with [`attn::dot_f16`]'s arithmetic.
    #[inline]
    pub fn dot_f16(&self, q: &[f32], k: &[half::f16]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            // SAFETY: both SIMD isas are detected only with AVX2, FMA and F16C.
            return unsafe { attn::f16c::dot_f16(q, k) };
        }
        attn::dot_f16(q, k)
    }

    /// `o += p * v` over an f16 row, with [`attn::axpy_f16`]'s arithmetic.
    #[inline]
    pub fn axpy_f16(&self, p: f32, v: &[half::f16], o: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            // SAFETY: as in `dot_f16`.
            return unsafe { attn::f16c::axpy_f16(p, v, o) };
        }
        attn::axpy_f16(p, v, o)
    }

    /// `q . k` over a `q8_0` row, with [`attn_q8::dot_q8_0`]'s arithmetic.
    #[inline]
    pub fn dot_q8_0(&self, q: &[f32], k: &[half::f16]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            // SAFETY: both SIMD isas are detected only with AVX2, FMA and F16C.
            return unsafe { attn_q8::avx2::dot_q8_0(q, k) };
        }
        attn_q8::dot_q8_0(q, k)
    }

    /// `o += p * v` over a `q8_0` row, with [`attn_q8::axpy_q8_0`]'s arithmetic.
    #[inline]
    pub fn axpy_q8_0(&self, p: f32, v: &[half::f16], o: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            // SAFETY: as in `dot_q8_0`.
            return unsafe { attn_q8::avx2::axpy_q8_0(p, v, o) };
        }
        attn_q8::axpy_q8_0(p, v, o)
    }
}

impl Kernels {
    /// One attention task in one call where a fused kernel exists for this isa and shape:
    /// AVX-512 with f16 rows ([`attn::fused`]: head widths [`attn::FUSED_HEAD_DIMS`], up to
    /// [`attn::FUSED_MAX_GROUP`] query heads per KV head), else AVX2 and AVX-512
    /// ([`attn::tiled`]: widths that are multiples of eight, up to [`attn::tiled::MAX_GROUP`]
    /// heads). `q` holds the query heads' rows rounded to the
    /// cache's type (as the generic path rounds them, [`crate::KvType::round`]), `k(t)` /
    /// `v(t)` the KV head's rows at position `t` (f16, or `q8_0` where `q8`), `scores` is
    /// scratch of `heads * n_pos` and `tile` of [`attn::tile_floats`]. Bitwise the generic
    /// path's result; returns false (nothing done) where there is no such kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_attention<'a>(
        &self,
        head_dim: usize,
        q: &[f32],
        n_pos: usize,
        scale: f32,
        q8: bool,
        k: impl Fn(usize) -> &'a [half::f16],
        v: impl Fn(usize) -> &'a [half::f16],
        scores: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        // The AVX-512 kernel takes f16 rows of its widths and groups; the tiled one the rest.
        #[cfg(target_arch = "x86_64")]
        let fused = self.isa == Isa::Avx512Vnni
            && !q8
            && attn::FUSED_HEAD_DIMS.contains(&head_dim)
            && (1..=attn::FUSED_MAX_GROUP).contains(&(q.len() / head_dim));
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar && !fused {
            // SAFETY: the isa (AVX2, FMA, F16C, and AVX-512 F/VL where it is Avx512Vnni) was checked
            // when these kernels were made; lengths are asserted inside.
            return unsafe {
                attn::tiled::block(
                    self.isa == Isa::Avx512Vnni,
                    head_dim,
                    q,
                    &[(0, n_pos)],
                    scale,
                    q8,
                    k,
                    v,
                    scores,
                    tile,
                    out,
                )
            };
        }
        #[cfg(target_arch = "x86_64")]
        if fused {
            use attn::fused::heads;
            macro_rules! by_group {
                ($ch:literal) => {
                    match q.len() / head_dim {
                        1 => heads::<1, $ch>(q, n_pos, scale, k, v, scores, out),
                        2 => heads::<2, $ch>(q, n_pos, scale, k, v, scores, out),
                        3 => heads::<3, $ch>(q, n_pos, scale, k, v, scores, out),
                        4 => heads::<4, $ch>(q, n_pos, scale, k, v, scores, out),
                        5 => heads::<5, $ch>(q, n_pos, scale, k, v, scores, out),
                        6 => heads::<6, $ch>(q, n_pos, scale, k, v, scores, out),
                        7 => heads::<7, $ch>(q, n_pos, scale, k, v, scores, out),
                        8 => heads::<8, $ch>(q, n_pos, scale, k, v, scores, out),
                        _ => return false,
                    }
                };
            }
            // SAFETY: the isa (AVX-512 F/VL with AVX2, FMA, F16C) was checked when these
            // kernels were made; lengths are asserted inside.
            unsafe {
                match head_dim {
                    64 => by_group!(8),
                    128 => by_group!(16),
                    256 => by_group!(32),
                    _ => return false,
                }
            }
            return true;
        }
        let _ = (head_dim, q, n_pos, scale, q8, k, v, scores, tile, out);
        false
    }

    /// Most rows [`Kernels::attention_block`] takes in one call on this isa (1: none).
    pub fn attention_block_rows(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        if matches!(self.isa, Isa::Avx2 | Isa::Avx512Vnni) {
            return attn::MAX_BLOCK_ROWS;
        }
        1
    }

    /// Attention of a block of query rows of one session in one call, where this isa has such
    /// a kernel (AVX2 and AVX-512: [`attn::tiled::block`], widths that are multiples of eight, up to
    /// [`attn::tiled::MAX_GROUP`] heads per KV head and [`attn::MAX_BLOCK_ROWS`] rows): row `r`
    /// attends to the absolute positions `ranges[r].0..ranges[r].0 + ranges[r].1`, `q` holds
    /// its heads' rows (rounded to the cache's type) at `r * heads * head_dim`, `k(t)` / `v(t)`
    /// are the KV head's rows at position `t` (f16, or `q8_0` where `q8`), `scores` is scratch
    /// of `heads * Σ n_pos` and `tile`
    /// of [`attn::tile_floats`]. Each row's result is bitwise the generic path's for that row
    /// alone; returns false (nothing done) where there is no such kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_block<'a>(
        &self,
        head_dim: usize,
        q: &[f32],
        ranges: &[(usize, usize)],
        scale: f32,
        q8: bool,
        k: impl Fn(usize) -> &'a [half::f16],
        v: impl Fn(usize) -> &'a [half::f16],
        scores: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self.isa, Isa::Avx2 | Isa::Avx512Vnni) {
            // SAFETY: the isa (AVX2, FMA, F16C, and AVX-512 F/VL where it is Avx512Vnni) was checked
            // when these kernels were made; lengths are asserted inside.
            return unsafe {
                attn::tiled::block(
                    self.isa == Isa::Avx512Vnni,
                    head_dim,
                    q,
                    ranges,
                    scale,
                    q8,
                    k,
                    v,
                    scores,
                    tile,
                    out,
                )
            };
        }
        let _ = (head_dim, q, ranges, scale, q8, k, v, scores, tile, out);
        false
    }
}

impl Kernels {
    /// `g[i] = silu(g[i]) * u[i]`, bitwise [`exp::silu_mul`].
    pub fn silu_mul(&self, g: &mut [f32], u: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx512Vnni {
            // SAFETY: the isa (AVX-512 F/VL with AVX2 and FMA) was checked when these kernels
            // were made.
            return unsafe { exp::avx512::silu_mul(g, u) };
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx2 {
            // SAFETY: the isa (AVX2 and FMA) was checked when these kernels were made.
            return unsafe { exp::avx2::silu_mul(g, u) };
        }
        exp::silu_mul(g, u)
    }

    /// `g[i] = act(g[i]) * u[i]` for the FFN's activation.
    pub fn act_mul(&self, act: crate::config::FfnAct, g: &mut [f32], u: &[f32]) {
        match act {
            crate::config::FfnAct::Silu => self.silu_mul(g, u),
            crate::config::FfnAct::GeluTanh => gelu::gelu_mul(g, u),
        }
    }
}

/// Most activation rows one call of the panel kernel takes.
pub const PANEL_ACTS: usize = 8;

/// The version of the numeric contract every kernel follows: what a shard's results are a
/// function of besides its weights and inputs. Weight products run on panels with exact
/// integer block sums and one fused multiply-add per block and row
/// ([`packed::panel_reference`]); attention, SiLU, softmax and `exp` have one order of
/// operations each; so the scalar, AVX2 and AVX-512 kernels give bitwise the same results, and
/// shards on different CPUs may be chained or replicated. A change of any kernel's arithmetic
/// is a new version; shards of different versions are never mixed (the cache recipe carries
/// it).
pub const NUMERIC_CONTRACT: u32 = 1;

impl Kernels {
    /// Whether weights should be repacked at load for [`Kernels::packed_panels`]: always, with
    /// every instruction set. The scalar, AVX2 and AVX-512 panel kernels give bitwise the
    /// results of [`packed::panel_reference`], so the instruction set never changes a product.
    pub fn packs_weights(&self) -> bool {
        true
    }

    /// Quantizes one activation row for a packed matrix ([`packed::quantize_act_row`]'s bytes).
    pub fn quantize_packed_act(&self, layout: &packed::Layout, x: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx512Vnni {
            // SAFETY: the isa was checked when these kernels were made.
            return unsafe {
                if layout.kind.is_k() {
                    packed::vnni::quantize_k_act_row(layout, x, out)
                } else {
                    packed::vnni::quantize_act_row(layout, x, out)
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx2 && layout.kind.is_k() {
            // SAFETY: the isa was checked when these kernels were made.
            return unsafe { packed::avx2::quantize_k_act_row(layout, x, out) };
        }
        packed::quantize_act_row(layout, x, out)
    }

    /// Weight rows `0..n_rows` of the consecutive panels `w` (a run of a packed matrix) times
    /// the packed activation rows `a`: row `r` . `a[j]` is written to `out[j * stride + r]`.
    /// Activation rows go through the kernel as many at a time as the isa's registers hold
    /// ([`PANEL_ACTS`] with AVX-512, four with AVX2), then four, two, one; each element is
    /// computed by the same instruction sequence whatever the grouping (and equals
    /// [`packed::panel_reference`] bitwise), so grouping never changes a result.
    ///
    /// # Safety
    /// `out[j * stride + r]` must be valid for writes, and written by no one else meanwhile,
    /// for every `j < a.len()` and `r < n_rows`.
    pub unsafe fn packed_panels(
        &self,
        layout: &packed::Layout,
        w: &[u8],
        n_rows: usize,
        a: &[&[u8]],
        out: *mut f32,
        stride: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.isa != Isa::Scalar {
            use packed::vnni::kind_id;
            use packed::vnni::{Q2K, Q3K, Q40, Q41, Q4K, Q50, Q51, Q5K, Q6K, Q8};
            // AVX2 has half of AVX-512's vector registers: four activation rows a call at most.
            let most = if self.isa == Isa::Avx512Vnni { 8 } else { 4 };
            macro_rules! by_rows {
                ($isa:ident, $run:ident, $k:expr) => {{
                    const K: u8 = $k;
                    let mut j = 0;
                    while j < a.len() {
                        let left = a.len() - j;
                        // SAFETY: the isa was checked when these kernels were made; the panels
                        // and activation rows are sized by `layout` (asserted inside); output
                        // rows `j..` are within the caller's contract.
                        unsafe {
                            let o = out.add(j * stride);
                            if left >= 8 && most >= 8 {
                                let rows = std::array::from_fn(|i| a[j + i]);
                                packed::$isa::$run::<K, 8>(layout, w, n_rows, rows, o, stride);
                                j += 8;
                            } else if left >= 4 {
                                let rows = std::array::from_fn(|i| a[j + i]);
                                packed::$isa::$run::<K, 4>(layout, w, n_rows, rows, o, stride);
                                j += 4;
                            } else if left >= 2 {
                                let rows = std::array::from_fn(|i| a[j + i]);
                                packed::$isa::$run::<K, 2>(layout, w, n_rows, rows, o, stride);
                                j += 2;
                            } else {
                                packed::$isa::$run::<K, 1>(layout, w, n_rows, [a[j]], o, stride);
                                j += 1;
                            }
                        }
                    }
                }};
            }
            macro_rules! by_kind {
                ($isa:ident) => {
                    match kind_id(layout.kind) {
                        Q40 => by_rows!($isa, panels, Q40),
                        Q41 => by_rows!($isa, panels, Q41),
                        Q50 => by_rows!($isa, panels, Q50),
                        Q51 => by_rows!($isa, panels, Q51),
                        Q8 => by_rows!($isa, panels, Q8),
                        Q2K => by_rows!($isa, panels_k, Q2K),
                        Q3K => by_rows!($isa, panels_k, Q3K),
                        Q4K => by_rows!($isa, panels_k, Q4K),
                        Q5K => by_rows!($isa, panels_k, Q5K),
                        _ => by_rows!($isa, panels_k, Q6K),
                    }
                };
            }
            if self.isa == Isa::Avx512Vnni {
                by_kind!(vnni);
            } else {
                by_kind!(avx2);
            }
            return;
        }
        let pb = layout.panel_bytes();
        const MOST: usize = packed::portable::MOST_ACTS;
        let mut products = [[0f32; packed::PANEL]; MOST];
        for (p, panel) in w
            .chunks_exact(pb)
            .take(n_rows.div_ceil(packed::PANEL))
            .enumerate()
        {
            let r0 = p * packed::PANEL;
            let valid = (n_rows - r0).min(packed::PANEL);
            for (c, acts) in a.chunks(MOST).enumerate() {
                let products = &mut products[..acts.len()];
                packed::portable::panel_products(layout, panel, acts, products);
                for (j, v) in products.iter().enumerate() {
                    let j = c * MOST + j;
                    for (r, v) in v.iter().enumerate().take(valid) {
                        // SAFETY: the caller's contract.
                        unsafe { out.add(j * stride + r0 + r).write(*v) };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel families of `isas` this CPU runs; the test names those it cannot run.
    fn runnable(isas: &[Isa], test: &str) -> Vec<(Isa, Kernels)> {
        isas.iter()
            .filter(|isa| isa.testable(test))
            .map(|&isa| (isa, Kernels::new(isa).expect("supported")))
            .collect()
    }

    /// A deterministic xorshift source of values in [-scale/2, scale/2) (for the kernel tests).
    pub(crate) fn uniform(seed: u32) -> impl FnMut(f32) -> f32 {
        let mut s = seed;
        move |scale| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32 - 0.5) * scale
        }
    }

    /// Deterministic test values in [-1, 1] (also used by `packed`'s tests).
    pub(super) fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Every SIMD path agrees with the scalar reference within float reassociation error, and
    /// the reference agrees with the dequantized f32 product.
    #[test]
    fn simd_paths_match_the_scalar_reference() {
        let simd = runnable(
            &[Isa::Avx2, Isa::Avx512Vnni],
            "simd_paths_match_the_scalar_reference",
        );
        let n = 1024;
        let x = data(n, 1);
        let wf = data(n, 2);
        let scalar = Kernels::new(Isa::Scalar).unwrap();
        let mut scratch = Vec::new();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::F16,
            GgmlType::F32,
        ] {
            let w = gguf::quant::quantize(ty, &wf).unwrap();
            let at = act::act_type(ty);
            let mut a = vec![0u8; at.row_bytes(n)];
            act::quantize_row(at, &x, &mut a);
            let mut wd = vec![0f32; n];
            gguf::quant::dequantize(ty, &w, &mut wd).unwrap();
            let mut ad = vec![0f32; n];
            gguf::quant::dequantize(at, &a, &mut ad).unwrap();
            let exact: f64 = wd.iter().zip(&ad).map(|(p, q)| *p as f64 * *q as f64).sum();
            let magnitude: f64 = wd
                .iter()
                .zip(&ad)
                .map(|(p, q)| (*p as f64 * *q as f64).abs())
                .sum();
            let reference = scalar.dot(ty, n, &w, &a, &mut scratch);
            // Q8_1 stores its block sums as f16, so allow that rounding on top of reassociation.
            assert!(
                (reference as f64 - exact).abs() < 2e-4 * (1.0 + magnitude),
                "{ty}: scalar {reference} vs exact {exact}"
            );
            for (isa, k) in &simd {
                let got = k.dot(ty, n, &w, &a, &mut scratch);
                assert!(
                    (got - reference).abs() <= 1e-4 * (1.0 + reference.abs()),
                    "{ty} {isa:?}: {got} vs scalar {reference}"
                );
            }
        }
    }

    /// The K-quant kernels sum each block exactly in integers and then take the scalar
    /// reference's float steps, so every instruction set gives its result bitwise: on weight
    /// blocks of arbitrary bytes (every bit pattern of values, scales and mins) and on full-scale
    /// activations, whose integer sums are the largest.
    #[test]
    fn k_quant_kernels_equal_the_scalar_reference_bitwise() {
        let simd = runnable(
            &[Isa::Avx2, Isa::Avx512Vnni],
            "k_quant_kernels_equal_the_scalar_reference_bitwise",
        );
        let scalar = Kernels::new(Isa::Scalar).unwrap();
        let mut scratch = Vec::new();
        let mut next = uniform(0x1234_5678);
        for (ty, f16_at) in [
            (GgmlType::Q2K, &[80, 82][..]),
            (GgmlType::Q3K, &[108]),
            (GgmlType::Q4K, &[0, 2]),
            (GgmlType::Q5K, &[0, 2]),
            (GgmlType::Q6K, &[208]),
        ] {
            for n in [256, 1536] {
                let mut w: Vec<u8> = (0..ty.row_bytes(n))
                    .map(|_| next(65536.0) as i32 as u8)
                    .collect();
                for blk in w.chunks_exact_mut(ty.type_size()) {
                    for &at in f16_at {
                        let d = half::f16::from_f32(next(0.02));
                        blk[at..at + 2].copy_from_slice(&d.to_le_bytes());
                    }
                }
                for full_scale in [false, true] {
                    let x: Vec<f32> = (0..n)
                        .map(|_| match full_scale {
                            true => next(2.0).signum(),
                            false => next(2.0),
                        })
                        .collect();
                    let mut a = vec![0u8; GgmlType::Q8K.row_bytes(n)];
                    act::quantize_row(GgmlType::Q8K, &x, &mut a);
                    let want = scalar.dot(ty, n, &w, &a, &mut scratch);
                    assert!(want.is_finite(), "{ty} n={n}");
                    for (isa, k) in &simd {
                        let got = k.dot(ty, n, &w, &a, &mut scratch);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty} {isa:?} n={n}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The multi-row kernels give bitwise the single-row results, for every row position.
    #[test]
    fn multi_row_kernels_equal_single_row_calls_bitwise() {
        let families = runnable(
            &[Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni],
            "multi_row_kernels_equal_single_row_calls_bitwise",
        );
        let mut scratch = Vec::new();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
        ] {
            let n = if ty == GgmlType::Q4K { 512 } else { 576 };
            let w = gguf::quant::quantize(ty, &data(n, 9)).unwrap();
            let at = act::act_type(ty);
            let acts: Vec<Vec<u8>> = (0..4)
                .map(|r| {
                    let mut a = vec![0u8; at.row_bytes(n)];
                    act::quantize_row(at, &data(n, 20 + r), &mut a);
                    a
                })
                .collect();
            for (isa, k) in &families {
                let four = k.dot4(
                    ty,
                    n,
                    &w,
                    [&acts[0], &acts[1], &acts[2], &acts[3]],
                    &mut scratch,
                );
                for (r, a) in acts.iter().enumerate() {
                    let one = k.dot(ty, n, &w, a, &mut scratch);
                    assert_eq!(four[r].to_bits(), one.to_bits(), "{ty} {isa:?} row {r}");
                }
            }
        }
    }
}
