//! Conversions between stored elements and the f32 compute type, one row slice at a time: the
//! `CpuElement` trait and the row kernel types (the implementations for f32, f16 and bf16 are in
//! `stored`, above the explicit AVX-512 rows they choose).

/// A `rms_norm` row kernel: `(x, weight, eps, out, stream)`; `stream` asks for non-temporal
/// stores of the output (which the kernel may ignore).
pub(crate) type RmsNormRow<T> = fn(&[T], Option<&[T]>, f32, &mut [T], bool);
/// A `fused_add_rms_norm` row kernel: `(x and where the norm goes, residual, weight, eps)`.
pub(crate) type FusedRow<T> = fn(RowOut<'_, T>, &mut [T], Option<&[T]>, f32);

/// Where a fused row reads x and writes the norm: x itself (the op, in place), or another row of
/// the same length (a fused composition that must leave x unchanged).
pub(crate) enum RowOut<'a, T> {
    /// Read x, write the norm over it.
    InPlace(&'a mut [T]),
    /// Read `x`, write the norm into `out`.
    Separate {
        /// The row read.
        x: &'a [T],
        /// The norm written.
        out: &'a mut [T],
    },
}

impl<T> RowOut<'_, T> {
    /// The row's length, checked equal on both sides.
    pub(crate) fn len(&self) -> usize {
        match self {
            RowOut::InPlace(x) => x.len(),
            RowOut::Separate { x, out } => {
                assert_eq!(x.len(), out.len(), "a fused row's input and output have one length");
                x.len()
            }
        }
    }

    /// The row read and the row written, as pointers (the same memory for `InPlace`): reading
    /// element i before writing it is all either form needs.
    pub(crate) fn pointers(&mut self) -> (*const T, *mut T) {
        match self {
            RowOut::InPlace(x) => {
                let p = x.as_mut_ptr();
                (p.cast_const(), p)
            }
            RowOut::Separate { x, out } => (x.as_ptr(), out.as_mut_ptr()),
        }
    }
}

/// An element type the CPU kernels store; rows are converted to and from f32 scratch in bulk.
pub(crate) trait CpuElement: bytemuck::Pod + Send + Sync {
    /// Widens `src` into `dst` (same length; exact).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` to this type into `dst` (same length; nearest-even, NaN stays NaN).
    fn store(src: &[f32], dst: &mut [Self]);

    /// [`CpuElement::store`] with non-temporal stores where the explicit rows have them (for an
    /// output larger than the last-level cache: its lines are not read before being written); the
    /// same bits. The caller calls [`fence_streaming`] before the output is read.
    #[inline(always)]
    fn store_streaming(src: &[f32], dst: &mut [Self]) {
        Self::store(src, dst);
    }

    /// Whether [`CpuElement::round_product`] rounds to this type (a few inlined bit operations that
    /// vectorize); otherwise it is the identity and callers round slices ([`CpuElement::round_in_place`]).
    const ROUNDS_PRODUCTS: bool = false;

    /// `v`, the f32 product of two values of this type, rounded to this type and widened back,
    /// inline, when [`CpuElement::ROUNDS_PRODUCTS`] (nearest-even; NaN stays NaN).
    #[inline(always)]
    fn round_product(v: f32) -> f32 {
        v
    }

    /// `v`, an f32 result of arithmetic on values of this type (so a NaN has no payload below the
    /// bits this type keeps), with the rounding to this type applied to its bits but not cut off,
    /// when [`CpuElement::ROUNDS_PRODUCTS`]: [`CpuElement::update_as_f32_pre_rounded`] cuts it. The
    /// identity otherwise.
    #[inline(always)]
    fn pre_round(v: f32) -> f32 {
        v
    }

    /// [`CpuElement::update_as_f32`] for an `f` that leaves every value of the row
    /// [`CpuElement::pre_round`]ed: the store keeps each value's top bits, the rounding already
    /// done (the same bits as rounding the values `f` would leave without `pre_round`). For a type
    /// that does not round products, [`CpuElement::update_as_f32`].
    #[inline(always)]
    fn update_as_f32_pre_rounded(row: &mut [Self], scratch: &mut [f32], f: impl FnOnce(&mut [f32])) {
        Self::update_as_f32(row, scratch, f);
    }

    /// An explicit SIMD `rms_norm` row for this type with a weight of this type, when the CPU has
    /// one and the portable rows are not forced ([`crate::row_path`]).
    #[inline(always)]
    fn simd_rms_norm_row() -> Option<RmsNormRow<Self>> {
        None
    }

    /// An explicit SIMD `fused_add_rms_norm` row, as [`CpuElement::simd_rms_norm_row`].
    #[inline(always)]
    fn simd_fused_row() -> Option<FusedRow<Self>> {
        None
    }

    /// `src` as f32 values: widened into `buffer` (same length), or `src` itself when it is f32.
    #[inline(always)]
    fn widen<'a>(src: &'a [Self], buffer: &'a mut [f32]) -> &'a [f32] {
        Self::load(src, buffer);
        buffer
    }

    /// Runs `f` on `row` as f32 values and stores the result back (rounded): `row` itself when it is
    /// f32, else widened into `scratch` (at least as long) and rounded back after.
    #[inline(always)]
    fn update_as_f32(row: &mut [Self], scratch: &mut [f32], f: impl FnOnce(&mut [f32])) {
        let values = &mut scratch[..row.len()];
        Self::load(row, values);
        f(values);
        Self::store(values, row);
    }

    /// Rounds each value to this type and back (nearest-even), in place. This default goes through
    /// [`CpuElement::store`] and [`CpuElement::load`] in stack-sized chunks.
    #[inline(always)]
    fn round_in_place(v: &mut [f32]) {
        const CHUNK: usize = 256;
        let mut stored = [Self::zeroed(); CHUNK];
        for chunk in v.chunks_mut(CHUNK) {
            let stored = &mut stored[..chunk.len()];
            Self::store(chunk, stored);
            Self::load(stored, chunk);
        }
    }

    /// Stores `y = s · rstd` rounded to this type, or with a weight `round(f32(round(y)) · w)`: y is
    /// rounded to the element type first, exactly as native does. This default goes through
    /// [`CpuElement::store`] and [`CpuElement::load`] in stack-sized chunks; types whose rounding is
    /// a few bit operations override it with one fused loop.
    #[inline(always)]
    fn store_normalized(s: &[f32], rstd: f32, weight: Option<&[f32]>, out: &mut [Self]) {
        const CHUNK: usize = 256;
        let mut y = [0f32; CHUNK];
        for (start, out) in (0..s.len()).step_by(CHUNK).zip(out.chunks_mut(CHUNK)) {
            let y = &mut y[..out.len()];
            for (y, v) in y.iter_mut().zip(&s[start..]) {
                *y = v * rstd;
            }
            Self::store(y, out);
            if let Some(weight) = weight {
                Self::load(out, y);
                for (y, w) in y.iter_mut().zip(&weight[start..]) {
                    *y *= *w;
                }
                Self::store(y, out);
            }
        }
    }
}

/// Orders the non-temporal stores of [`CpuElement::store_streaming`] before every later store, so
/// the output is complete when the kernel returns (a no-op where there are none).
#[inline(always)]
pub(crate) fn fence_streaming() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    // Miri runs no non-temporal store (it has no AVX-512, so the explicit rows never run) and does
    // not model `sfence`; a full fence orders at least as much.
    #[cfg(miri)]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// `v` rounded to bf16 bits: nearest-even; NaN keeps its sign and top payload bits and is quieted.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    // Round to nearest-even by adding 0x7fff plus the lowest kept bit, then truncating.
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) as u16) | 0x0040;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    if is_nan { nan } else { rounded }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn bf16_bit_conversions_match_half() {
        let values = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -3.25,
            65504.0,
            3.4e38,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            f32::MIN_POSITIVE,
        ];
        let mut stored = vec![bf16::ZERO; values.len()];
        bf16::store(&values, &mut stored);
        for (value, got) in values.iter().zip(&stored) {
            assert_eq!(got.to_bits(), bf16::from_f32(*value).to_bits(), "{value}");
        }
        let mut back = vec![0f32; values.len()];
        bf16::load(&stored, &mut back);
        for (got, s) in back.iter().zip(&stored) {
            assert_eq!(*got, s.to_f32());
        }
        let mut nan = [bf16::ZERO];
        bf16::store(&[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
        bf16::store(&[f32::from_bits(0x7f80_0001)], &mut nan);
        assert!(nan[0].is_nan(), "a signalling NaN with a low payload stays NaN");
    }

    /// Values whose rounding is decided by every rule: halfway cases, subnormals, NaN, overflow.
    fn deciding_values(n: usize) -> Vec<f32> {
        let special = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1e-40, -3e-39, f32::NAN, 3.4e38, 65519.0];
        (0..n)
            .map(|i| if i % 3 == 0 { special[i / 3 % special.len()] } else { (i as f32 * 0.731).sin() * 1e3 })
            .collect()
    }

    /// `store_streaming` into destinations at every offset from a 64-byte boundary (so both the
    /// streamed and the ordinary path run) gives `store`'s bits.
    #[cfg(target_arch = "x86_64")]
    fn streaming_matches_store<T: CpuElement + crate::avx512::Avx512Element>() -> bool {
        let mut streamed = false;
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 64, 100, 256] {
            let src = deciding_values(n);
            for offset in 0..4 {
                let mut expected = vec![<T as bytemuck::Zeroable>::zeroed(); n];
                T::store(&src, &mut expected);
                let mut buffer = vec![<T as bytemuck::Zeroable>::zeroed(); n + 64];
                let align = buffer.as_ptr().align_offset(64);
                let dst = &mut buffer[align + offset..align + offset + n];
                T::store_streaming(&src, dst);
                fence_streaming();
                let (got, want): (&[u8], &[u8]) = (bytemuck::cast_slice(dst), bytemuck::cast_slice(&expected));
                assert_eq!(got, want, "n {n} offset {offset}");
                if offset == 0 && crate::row_path().is_avx512() {
                    // From a 64-byte boundary every full group of 16 is streamed.
                    assert_eq!(crate::avx512::stream_store(&src, dst), n - n % 16, "n {n}");
                    fence_streaming();
                    streamed = true;
                }
            }
        }
        streamed
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streaming_stores_give_the_bits_of_ordinary_ones() {
        let streamed =
            [streaming_matches_store::<f32>(), streaming_matches_store::<bf16>(), streaming_matches_store::<f16>()];
        if !streamed.iter().all(|&s| s) {
            eprintln!(
                "skipped: no explicit AVX-512 rows on this CPU ({}), so only the ordinary stores were compared",
                crate::row_path()
            );
        }
    }
}
