//! Explicit AVX-512 row kernels of the norms for f32, bf16 and f16 (weight in x's dtype), chosen at run
//! time when the CPU has AVX-512F and the portable path is not forced ([`crate::row_path`]).
//!
//! The compiler's own vectorization of the portable rows keeps the 32 sum-of-squares lanes in
//! 2-wide registers and spills them (a 4096-value f32 row took about 1 µs); here they are two 16-lane
//! registers. The arithmetic is the portable path's, operation for operation: lane `i` of the two
//! accumulators sums the squares of the values `i, i + 32, …` in order (a multiply, then an add: no
//! fused multiply-add), the tree, tail and f64 fallback are the portable code
//! ([`rows::rstd_from_lanes`]), and bf16 rounding is the same nearest-even bit operation with the
//! same NaN rule, so both paths give the same bits (tested below on every length up to 300 and on
//! NaN, infinities, subnormals and rows whose f32 sum overflows).
//!
//! Where the CPU also has AVX512-BF16 (and AVX512-DQ), bf16 is rounded by `vcvtneps2bf16`, one
//! instruction for 16 values instead of eight: it rounds to nearest even and quiets NaN exactly as
//! the bit operation does, but treats a subnormal f32 input as zero: `vfpclassps` notes them
//! ([`Flushed`]), and a row (or a block of the fused row, which writes its inputs) that met one is
//! converted again by the bit operation. Every f32 whose bf16 rounding
//! is decided by its top 16 bits and a few low patterns is checked against the bit operation below,
//! and the rows of both variants against the portable rows. The same conversion serves the other
//! ops' bf16 stores ([`store_bf16`], [`round_bf16_in_place`]).
//!
//! `gelu_and_mul_sparse`'s gate has two helpers here: its f64 row sums in the portable lanes'
//! order ([`lane_sum_f64`]) and the packing of the values its relu keeps ([`pack_nonzero`]), so
//! gelu runs on those only.

use std::arch::x86_64::{
    __m256bh, __m256i, __m512, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm_sfence,
    _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512,
    _mm512_castps_si512, _mm512_castsi512_ps, _mm512_castsi512_si256, _mm512_cmp_ps_mask, _mm512_cvtepu16_epi32,
    _mm512_cvtneps_pbh, _mm512_cvtph_ps, _mm512_cvtps_ph, _mm512_fpclass_ps_mask, _mm512_loadu_ps, _mm512_loadu_si512,
    _mm512_mask_or_epi32, _mm512_mul_ps, _mm512_permutexvar_epi16, _mm512_set_epi16, _mm512_set1_epi32, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_slli_epi32, _mm512_srli_epi32, _mm512_storeu_ps, _mm512_stream_ps,
};
use std::arch::x86_64::{
    _CMP_NEQ_UQ, _mm_add_pd, _mm_cvtsd_f64, _mm_unpackhi_pd, _mm256_add_pd, _mm256_castpd256_pd128,
    _mm256_extractf128_pd, _mm256_loadu_ps, _mm512_add_pd, _mm512_castpd512_pd256, _mm512_cvtps_pd,
    _mm512_extractf64x4_pd, _mm512_maskz_compress_epi32, _mm512_maskz_compress_ps, _mm512_mul_pd, _mm512_set1_pd,
    _mm512_setr_epi32, _mm512_setzero_pd, _mm512_storeu_epi32, _mm512_sub_pd,
};

use half::bf16;

use crate::element::{CpuElement, FusedRow, RmsNormRow, RowOut};
use crate::rows::{self, LANES};

/// Vector lanes of one register.
const WIDTH: usize = 16;

/// An element type with AVX-512 loads and stores (widen to f32, round from f32).
///
/// `HW` asks for the AVX512-BF16 conversion where the type has one (bf16; the others ignore it): the
/// caller then guarantees AVX512-BF16 and AVX512-DQ as well.
pub(crate) trait Avx512Element: CpuElement {
    /// Whether rounding to this type has a faster hardware form (`HW = true`).
    const HARDWARE_ROUNDING: bool = false;

    /// Loads 16 values widened to f32.
    ///
    /// # Safety
    /// AVX-512F is available and `p` points to 16 readable values.
    unsafe fn load16(p: *const Self) -> __m512;

    /// Whether [`Avx512Element::load32`] returns the even and the odd values rather than the first
    /// and the last 16.
    const PAIRED: bool = false;

    /// Loads 32 values widened to f32 as two registers: values 0..16 and 16..32, or, when
    /// [`Avx512Element::PAIRED`], the even and the odd ones (cheaper for a type whose pairs fill a
    /// 32-bit lane). A sum of squares only needs each lane to see the same values in order.
    ///
    /// # Safety
    /// AVX-512F/BW are available and `p` points to 32 readable values.
    #[inline(always)]
    unsafe fn load32(p: *const Self) -> (__m512, __m512) {
        // SAFETY: the caller's contract.
        unsafe { (Self::load16(p), Self::load16(p.add(WIDTH))) }
    }
    /// 16 values in this type, in a register.
    type Packed: Copy;
    /// Rounds 16 f32 values to this type. With `HW`, a subnormal value the hardware conversion
    /// flushed is noted in `flushed`, and the result is then the caller's to redo with `HW = false`.
    ///
    /// # Safety
    /// AVX-512F/BW are available, and AVX512-BF16/DQ too when `HW`.
    unsafe fn pack16<const HW: bool>(v: __m512, flushed: &mut Flushed) -> Self::Packed;
    /// Stores 16 packed values.
    ///
    /// # Safety
    /// AVX-512F is available and `p` points to 16 writable values.
    unsafe fn store_packed(p: *mut Self, packed: Self::Packed);
    /// As [`Avx512Element::store_packed`] with a non-temporal store (past the caches).
    ///
    /// # Safety
    /// As `store_packed`, and `p` is aligned to the 16 values' size.
    unsafe fn stream_packed(p: *mut Self, packed: Self::Packed);
    /// Rounds 16 f32 values to this type and widens them back (`flushed` as for
    /// [`Avx512Element::pack16`]).
    ///
    /// # Safety
    /// As `pack16`.
    unsafe fn round16<const HW: bool>(v: __m512, flushed: &mut Flushed) -> __m512;

    /// Rounds 16 f32 values to this type and stores them (`flushed` as for
    /// [`Avx512Element::pack16`]).
    ///
    /// # Safety
    /// As `pack16` and `store_packed`.
    #[inline(always)]
    unsafe fn store16<const HW: bool>(p: *mut Self, v: __m512, flushed: &mut Flushed) {
        // SAFETY: the caller's contract.
        unsafe { Self::store_packed(p, Self::pack16::<HW>(v, flushed)) }
    }
    /// As [`Avx512Element::store16`] with a non-temporal store.
    ///
    /// # Safety
    /// As `pack16` and `stream_packed`.
    #[inline(always)]
    unsafe fn stream16<const HW: bool>(p: *mut Self, v: __m512, flushed: &mut Flushed) {
        // SAFETY: the caller's contract.
        unsafe { Self::stream_packed(p, Self::pack16::<HW>(v, flushed)) }
    }
}

/// The subnormal f32 values the hardware bf16 conversion met, as OR-ed `vfpclassps` masks.
/// `vcvtneps2bf16` flushes them to zero, so whatever was converted in hardware while this
/// accumulator was passed is redone with the bit operation when it is set: one check per row or
/// block instead of a branch per vector: about 5% of a bf16 row (the `vfpclassps` per conversion
/// remains; with no check at all the row ran 14–23% faster, but subnormals would be flushed).
#[derive(Clone, Copy, Default)]
pub(crate) struct Flushed(u16);

impl Flushed {
    #[inline(always)]
    fn note(&mut self, subnormal: u16) {
        self.0 |= subnormal;
    }

    /// Whether any converted value was subnormal.
    #[inline(always)]
    pub(crate) fn any(self) -> bool {
        self.0 != 0
    }
}

impl Avx512Element for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(p) }
    }

    type Packed = __m512;

    #[inline(always)]
    unsafe fn pack16<const HW: bool>(v: __m512, _flushed: &mut Flushed) -> __m512 {
        v
    }

    #[inline(always)]
    unsafe fn store_packed(p: *mut f32, packed: __m512) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(p, packed) }
    }

    #[inline(always)]
    unsafe fn stream_packed(p: *mut f32, packed: __m512) {
        // SAFETY: the caller's contract (64-byte aligned).
        unsafe { _mm512_stream_ps(p, packed) }
    }

    #[inline(always)]
    unsafe fn round16<const HW: bool>(v: __m512, _flushed: &mut Flushed) -> __m512 {
        v
    }
}

impl Avx512Element for bf16 {
    const HARDWARE_ROUNDING: bool = true;
    const PAIRED: bool = true;

    #[inline(always)]
    unsafe fn load32(p: *const bf16) -> (__m512, __m512) {
        // SAFETY: the caller's contract. Lane k holds values 2k (low half) and 2k + 1 (high half):
        // each widens exactly by moving it to the top half of the lane.
        unsafe {
            let pairs = _mm512_loadu_si512(p.cast());
            let even = _mm512_slli_epi32::<16>(pairs);
            let odd = _mm512_and_si512(pairs, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
        }
    }

    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> __m512 {
        // SAFETY: the caller's contract; bf16 widens exactly by a 16-bit shift.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))) }
    }

    type Packed = __m256i;

    #[inline(always)]
    unsafe fn pack16<const HW: bool>(v: __m512, flushed: &mut Flushed) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { to_bf16::<HW>(v, flushed) }
    }

    #[inline(always)]
    unsafe fn store_packed(p: *mut bf16, packed: __m256i) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_si256(p.cast(), packed) }
    }

    #[inline(always)]
    unsafe fn stream_packed(p: *mut bf16, packed: __m256i) {
        // SAFETY: the caller's contract (32-byte aligned).
        unsafe { _mm256_stream_si256(p.cast(), packed) }
    }

    #[inline(always)]
    unsafe fn round16<const HW: bool>(v: __m512, flushed: &mut Flushed) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            if HW {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(to_bf16::<true>(v, flushed))))
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bf16_bits(v)))
            }
        }
    }
}

impl Avx512Element for half::f16 {
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> __m512 {
        // SAFETY: the caller's contract (F16C's conversion is part of AVX-512F); exact.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    type Packed = __m256i;

    #[inline(always)]
    unsafe fn pack16<const HW: bool>(v: __m512, _flushed: &mut Flushed) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { to_f16(v) }
    }

    #[inline(always)]
    unsafe fn store_packed(p: *mut half::f16, packed: __m256i) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_si256(p.cast(), packed) }
    }

    #[inline(always)]
    unsafe fn stream_packed(p: *mut half::f16, packed: __m256i) {
        // SAFETY: the caller's contract (32-byte aligned).
        unsafe { _mm256_stream_si256(p.cast(), packed) }
    }

    #[inline(always)]
    unsafe fn round16<const HW: bool>(v: __m512, _flushed: &mut Flushed) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_cvtph_ps(to_f16(v)) }
    }
}

/// 16 f32 values rounded to f16 (nearest-even, subnormals kept: the hardware conversion `half`
/// itself uses where the CPU has F16C, so the portable path's bits).
#[inline(always)]
unsafe fn to_f16(v: __m512) -> std::arch::x86_64::__m256i {
    // SAFETY: the caller guarantees AVX-512F.
    unsafe { _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
}

/// The low 16 bits of each 32-bit lane, in order, as 256 bits. A word permutation rather than
/// `vpmovdw`: with a memory operand the compiler folds that into a store, which is microcoded and
/// slow on AMD Zen 4 (it was the bf16 row's hot spot).
#[inline(always)]
unsafe fn narrow(v: std::arch::x86_64::__m512i) -> __m256i {
    // SAFETY: the caller guarantees AVX-512F/BW.
    unsafe {
        let low_words = _mm512_set_epi16(
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0,
        );
        _mm512_castsi512_si256(_mm512_permutexvar_epi16(low_words, v))
    }
}

/// 16 f32 values rounded to bf16, in order: by `vcvtneps2bf16` when `HW` (the caller guarantees
/// AVX512-BF16 and AVX512-DQ), which flushes a subnormal value to zero: that is noted in `flushed`
/// for the caller to redo with `HW = false`, the bit operation. The same bits either way.
#[inline(always)]
unsafe fn to_bf16<const HW: bool>(v: __m512, flushed: &mut Flushed) -> __m256i {
    // SAFETY: the caller guarantees AVX-512F/BW, and AVX512-BF16/DQ when `HW`.
    unsafe {
        if HW {
            // `vfpclassps` category 0x20: subnormal.
            flushed.note(_mm512_fpclass_ps_mask::<0x20>(v));
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
        } else {
            narrow(bf16_bits(v))
        }
    }
}

/// The bf16 bits of 16 f32 values in the low halves of 32-bit lanes: the portable `bf16_bits`
/// (add `0x7fff` plus the lowest kept bit, shift; NaN keeps its top bits and is quieted).
#[inline(always)]
unsafe fn bf16_bits(v: __m512) -> std::arch::x86_64::__m512i {
    // SAFETY: the caller guarantees AVX-512F.
    unsafe {
        let bits = _mm512_castps_si512(v);
        let high = _mm512_srli_epi32::<16>(bits);
        let lowest_kept = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let rounded =
            _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lowest_kept));
        let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40))
    }
}

/// `1 / sqrt(mean(v²) + eps)` of the row `v = x` (or `x + r`): the full 32-value groups in two
/// registers, then the portable finish.
#[target_feature(enable = "avx512f,avx512bw")]
fn rstd<T: Avx512Element>(x: &[T], r: Option<&[T]>, eps: f32) -> f32 {
    let full = x.len() - x.len() % LANES;
    let (mut low, mut high) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i < full {
        // SAFETY: `i + 32 <= full <= x.len()` (and `r.len() == x.len()`); AVX-512F is enabled here.
        unsafe {
            let (mut a, mut b) = T::load32(x.as_ptr().add(i));
            if let Some(r) = r {
                let (ra, rb) = T::load32(r.as_ptr().add(i));
                a = _mm512_add_ps(a, ra);
                b = _mm512_add_ps(b, rb);
            }
            low = _mm512_add_ps(low, _mm512_mul_ps(a, a));
            high = _mm512_add_ps(high, _mm512_mul_ps(b, b));
        }
        i += LANES;
    }
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds 32 values.
    unsafe {
        _mm512_storeu_ps(lanes.as_mut_ptr(), low);
        _mm512_storeu_ps(lanes.as_mut_ptr().add(WIDTH), high);
    }
    if T::PAIRED {
        // Lane k of `low` summed the values 2k of each group, of `high` the values 2k + 1: the
        // portable lanes 2k and 2k + 1.
        let (even, odd) = lanes.split_at(WIDTH);
        let mut ordered = [0f32; LANES];
        for k in 0..WIDTH {
            ordered[2 * k] = even[k];
            ordered[2 * k + 1] = odd[k];
        }
        lanes = ordered;
    }
    rows::rstd_from_lanes(lanes, x, r, eps)
}

/// `y = v · rstd`, weighted as the portable `store_normalized` does (round y first, then multiply;
/// `flushed` as for [`Avx512Element::pack16`]).
#[inline(always)]
unsafe fn normalized<T: Avx512Element, const HW: bool>(
    v: __m512,
    rstd: __m512,
    weight: Option<&[T]>,
    i: usize,
    flushed: &mut Flushed,
) -> __m512 {
    // SAFETY: the caller's contract: AVX-512F, and `i + 16 <= weight.len()`.
    unsafe {
        let y = _mm512_mul_ps(v, rstd);
        match weight {
            Some(w) => _mm512_mul_ps(T::round16::<HW>(y, flushed), T::load16(w.as_ptr().add(i))),
            None => y,
        }
    }
}

/// One `rms_norm` row (see [`rows`] for the rule): vectors of 16, then the portable tail. With
/// `HW`, a row whose values met the hardware bf16 conversion as subnormals is written again with the
/// bit operation (x is only read, so the row can be).
///
/// # Safety
/// AVX-512F/BW are available, and AVX512-BF16/DQ when `HW`.
#[inline(always)]
unsafe fn rms_norm_row<T: Avx512Element, const HW: bool>(
    x: &[T],
    weight: Option<&[T]>,
    eps: f32,
    out: &mut [T],
    stream: bool,
) {
    let n = x.len();
    assert!(out.len() == n && weight.is_none_or(|w| w.len() == n), "row lengths agree");
    // SAFETY: the caller's contract.
    let rstd = unsafe { rstd(x, None, eps) };
    // Non-temporal stores need each 16-value store aligned to its size: the row's start is.
    let stream = stream && (out.as_ptr() as usize).is_multiple_of(WIDTH * size_of::<T>());
    let mut flushed = Flushed::default();
    // SAFETY: the caller's contract.
    unsafe { rms_norm_vectors::<T, HW>(x, weight, rstd, out, stream, &mut flushed) };
    if HW && flushed.any() {
        // SAFETY: the caller's contract.
        unsafe { rms_norm_vectors::<T, false>(x, weight, rstd, out, stream, &mut flushed) };
    }
    let full = n - n % WIDTH;
    let mut values = [0f32; WIDTH];
    let mut w = [0f32; WIDTH];
    let tail = &mut values[..n - full];
    T::load(&x[full..], tail);
    let weight = weight.map(|weight| {
        T::load(&weight[full..], &mut w[..n - full]);
        &w[..n - full]
    });
    T::store_normalized(tail, rstd, weight, &mut out[full..]);
}

/// The full 16-value groups of an `rms_norm` row, normalized by `rstd` into `out` (streamed when
/// `stream`: `out` is then aligned to 16 values).
///
/// # Safety
/// As [`rms_norm_row`]; the lengths agree.
#[inline(always)]
unsafe fn rms_norm_vectors<T: Avx512Element, const HW: bool>(
    x: &[T],
    weight: Option<&[T]>,
    rstd: f32,
    out: &mut [T],
    stream: bool,
    flushed: &mut Flushed,
) {
    let n = x.len();
    // SAFETY: the caller's contract.
    let scale = unsafe { _mm512_set1_ps(rstd) };
    let full = n - n % WIDTH;
    let mut i = 0;
    while i < full {
        // SAFETY: `i + 16 <= n` for x, out and the weight (the caller checked the lengths); the
        // features are enabled; streamed stores are aligned (the start is, and each store advances
        // by its size).
        unsafe {
            let y = normalized::<T, HW>(T::load16(x.as_ptr().add(i)), scale, weight, i, flushed);
            if stream {
                T::stream16::<HW>(out.as_mut_ptr().add(i), y, flushed);
            } else {
                T::store16::<HW>(out.as_mut_ptr().add(i), y, flushed);
            }
        }
        i += WIDTH;
    }
    if stream {
        // Order the non-temporal stores before whatever follows (the row's tail, the thread's join).
        // SAFETY: the caller's contract (SSE is part of x86_64).
        unsafe { _mm_sfence() };
    }
}

/// Vectors of 16 a `fused_add_rms_norm` row converts before it checks for flushed subnormals.
const FUSED_BLOCK: usize = 4;

/// One `fused_add_rms_norm` row, the norm over x or into another row (see [`rows`]): blocks of
/// [`FUSED_BLOCK`] vectors, single vectors, then the portable tail.
///
/// # Safety
/// AVX-512F/BW are available, and AVX512-BF16/DQ when `HW`.
#[inline(always)]
unsafe fn fused_row<T: Avx512Element, const HW: bool>(
    mut x: RowOut<'_, T>,
    r: &mut [T],
    weight: Option<&[T]>,
    eps: f32,
) {
    let n = x.len();
    assert!(r.len() == n && weight.is_none_or(|w| w.len() == n), "row lengths agree");
    let (x, out) = x.pointers();
    // SAFETY: the caller's contract; `x` points to `n` readable values, and the slice ends before
    // anything is written.
    let rstd = unsafe { rstd(std::slice::from_raw_parts(x, n), Some(r), eps) };
    // SAFETY: the caller's contract.
    let scale = unsafe { _mm512_set1_ps(rstd) };
    let full = n - n % WIDTH;
    let blocks = full - full % (FUSED_BLOCK * WIDTH);
    let mut i = 0;
    while i < blocks {
        // SAFETY: `i + 64 <= n` for x, the norm, r and the weight (checked above).
        unsafe { fused_vectors::<T, HW, FUSED_BLOCK>(x.add(i), r.as_mut_ptr().add(i), out.add(i), weight, i, scale) };
        i += FUSED_BLOCK * WIDTH;
    }
    while i < full {
        // SAFETY: `i + 16 <= n` for x, the norm, r and the weight (checked above).
        unsafe { fused_vectors::<T, HW, 1>(x.add(i), r.as_mut_ptr().add(i), out.add(i), weight, i, scale) };
        i += WIDTH;
    }
    let mut sum = [0f32; WIDTH];
    let mut w = [0f32; WIDTH];
    let sum = &mut sum[..n - full];
    // SAFETY: the tail of x, read (and its borrow ended) before the norm's tail is written.
    rows::add_widened(unsafe { std::slice::from_raw_parts(x.add(full), n - full) }, &r[full..], sum);
    T::store(sum, &mut r[full..]);
    let weight = weight.map(|weight| {
        T::load(&weight[full..], &mut w[..n - full]);
        &w[..n - full]
    });
    // SAFETY: the norm's tail, with no other borrow of it alive.
    T::store_normalized(sum, rstd, weight, unsafe { std::slice::from_raw_parts_mut(out.add(full), n - full) });
}

/// `K` vectors of 16 of a fused row at `x`, `r` and `out` (the weight's values from `at`): every
/// value is read and converted before any is written (the norm may be x itself), and with `HW` a
/// block whose conversions flushed a subnormal is converted again with the bit operation.
///
/// # Safety
/// As [`fused_row`]; `16 · K` values are readable at `x`, writable at `r` and `out`, and readable
/// in the weight from `at`.
#[inline(always)]
unsafe fn fused_vectors<T: Avx512Element, const HW: bool, const K: usize>(
    x: *const T,
    r: *mut T,
    out: *mut T,
    weight: Option<&[T]>,
    at: usize,
    scale: __m512,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut sums = [_mm512_setzero_ps(); K];
        for (k, sum) in sums.iter_mut().enumerate() {
            *sum = _mm512_add_ps(T::load16(x.add(k * WIDTH)), T::load16(r.add(k * WIDTH)));
        }
        let mut flushed = Flushed::default();
        let mut packed = [(T::pack16::<HW>(sums[0], &mut flushed), T::pack16::<HW>(sums[0], &mut flushed)); K];
        for (k, packed) in packed.iter_mut().enumerate() {
            let norm = normalized::<T, HW>(sums[k], scale, weight, at + k * WIDTH, &mut flushed);
            *packed = (T::pack16::<HW>(sums[k], &mut flushed), T::pack16::<HW>(norm, &mut flushed));
        }
        if HW && flushed.any() {
            for (k, packed) in packed.iter_mut().enumerate() {
                let norm = normalized::<T, false>(sums[k], scale, weight, at + k * WIDTH, &mut flushed);
                *packed = (T::pack16::<false>(sums[k], &mut flushed), T::pack16::<false>(norm, &mut flushed));
            }
        }
        for (k, (sum, norm)) in packed.into_iter().enumerate() {
            T::store_packed(r.add(k * WIDTH), sum);
            T::store_packed(out.add(k * WIDTH), norm);
        }
    }
}

/// The rows compiled for AVX-512F/BW (bf16 rounded by the bit operation).
#[target_feature(enable = "avx512f,avx512bw")]
fn rms_norm_row_avx512<T: Avx512Element>(x: &[T], weight: Option<&[T]>, eps: f32, out: &mut [T], stream: bool) {
    // SAFETY: the features are enabled here.
    unsafe { rms_norm_row::<T, false>(x, weight, eps, out, stream) }
}

#[target_feature(enable = "avx512f,avx512bw")]
fn fused_row_avx512<T: Avx512Element>(x: RowOut<'_, T>, r: &mut [T], weight: Option<&[T]>, eps: f32) {
    // SAFETY: the features are enabled here.
    unsafe { fused_row::<T, false>(x, r, weight, eps) }
}

/// The rows compiled for AVX-512F/BW/DQ and AVX512-BF16 (bf16 rounded by `vcvtneps2bf16`).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
fn rms_norm_row_bf16<T: Avx512Element>(x: &[T], weight: Option<&[T]>, eps: f32, out: &mut [T], stream: bool) {
    // SAFETY: the features are enabled here.
    unsafe { rms_norm_row::<T, true>(x, weight, eps, out, stream) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
fn fused_row_bf16<T: Avx512Element>(x: RowOut<'_, T>, r: &mut [T], weight: Option<&[T]>, eps: f32) {
    // SAFETY: the features are enabled here.
    unsafe { fused_row::<T, true>(x, r, weight, eps) }
}

/// The AVX-512 `rms_norm` row, when this CPU has AVX-512F/BW: with the hardware bf16 rounding where
/// `T` has one and the CPU runs it.
pub(crate) fn rms_norm_row_fn<T: Avx512Element>() -> Option<RmsNormRow<T>> {
    available().then(|| if T::HARDWARE_ROUNDING && hardware_bf16() { rms_hardware::<T> } else { rms_plain::<T> })
}

/// The AVX-512 `fused_add_rms_norm` row, chosen as [`rms_norm_row_fn`] is.
pub(crate) fn fused_row_fn<T: Avx512Element>() -> Option<FusedRow<T>> {
    available().then(|| if T::HARDWARE_ROUNDING && hardware_bf16() { fused_hardware::<T> } else { fused_plain::<T> })
}

// The row functions handed out above: each only after its CPU features were detected.

fn rms_plain<T: Avx512Element>(x: &[T], weight: Option<&[T]>, eps: f32, out: &mut [T], stream: bool) {
    // SAFETY: handed out only after AVX-512F/BW were detected.
    unsafe { rms_norm_row_avx512(x, weight, eps, out, stream) }
}

fn rms_hardware<T: Avx512Element>(x: &[T], weight: Option<&[T]>, eps: f32, out: &mut [T], stream: bool) {
    // SAFETY: handed out only after AVX-512F/BW/DQ and AVX512-BF16 were detected.
    unsafe { rms_norm_row_bf16(x, weight, eps, out, stream) }
}

fn fused_plain<T: Avx512Element>(x: RowOut<'_, T>, r: &mut [T], weight: Option<&[T]>, eps: f32) {
    // SAFETY: handed out only after AVX-512F/BW were detected.
    unsafe { fused_row_avx512(x, r, weight, eps) }
}

fn fused_hardware<T: Avx512Element>(x: RowOut<'_, T>, r: &mut [T], weight: Option<&[T]>, eps: f32) {
    // SAFETY: handed out only after AVX-512F/BW/DQ and AVX512-BF16 were detected.
    unsafe { fused_row_bf16(x, r, weight, eps) }
}

/// Whether this CPU runs the AVX-512 rows.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw")
}

/// Whether this CPU also rounds to bf16 in hardware (AVX512-BF16, with AVX512-DQ's `vfpclassps`
/// for the subnormal check).
pub(crate) fn hardware_bf16() -> bool {
    available() && std::arch::is_x86_feature_detected!("avx512dq") && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// Rounds `src` to bf16 into `dst` (same length) with `vcvtneps2bf16`: the portable bits.
///
/// # Safety
/// [`hardware_bf16`] is true.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
pub(crate) unsafe fn store_bf16(src: &[f32], dst: &mut [bf16]) {
    let n = src.len().min(dst.len());
    let full = n - n % WIDTH;
    let mut flushed = Flushed::default();
    // SAFETY: the features are enabled here; both slices hold `full` values.
    unsafe { store_vectors::<true>(&src[..full], &mut dst[..full], &mut flushed) };
    if flushed.any() {
        // A subnormal was flushed: the whole run again with the bit operation (`src` is unchanged).
        // SAFETY: as above.
        unsafe { store_vectors::<false>(&src[..full], &mut dst[..full], &mut flushed) };
    }
    for (d, s) in dst[full..n].iter_mut().zip(&src[full..n]) {
        *d = bf16::from_bits(crate::element::bf16_bits(*s));
    }
}

/// Rounds `src` (whole vectors of 16) to bf16 into `dst` (as long).
///
/// # Safety
/// AVX-512F/BW are available, and AVX512-BF16/DQ too when `HW`.
#[inline(always)]
unsafe fn store_vectors<const HW: bool>(src: &[f32], dst: &mut [bf16], flushed: &mut Flushed) {
    let mut i = 0;
    while i < src.len() {
        // SAFETY: `i + 16 <= src.len() == dst.len()`; the caller's contract.
        unsafe { bf16::store16::<HW>(dst.as_mut_ptr().add(i), _mm512_loadu_ps(src.as_ptr().add(i)), flushed) };
        i += WIDTH;
    }
}

/// Rounds `src` to `T` into the start of `dst` with non-temporal stores (16 values at a time, past
/// the caches: an output larger than the last-level cache is then not read before it is written;
/// the caller fences them with [`crate::element::fence_streaming`]); returns how many values it stored: 0 when `dst` does not start aligned
/// to 16 values, otherwise every full group of 16 (the caller stores the rest). The bits of
/// [`Avx512Element::store16`], with the hardware bf16 conversion where the CPU has it.
pub(crate) fn stream_store<T: Avx512Element>(src: &[f32], dst: &mut [T]) -> usize {
    if !available() {
        return 0;
    }
    if hardware_bf16() {
        // SAFETY: `hardware_bf16` checked every feature the function enables.
        unsafe { stream_store_hardware(src, dst) }
    } else {
        // SAFETY: `available` checked AVX-512F/BW.
        unsafe { stream_store_plain(src, dst) }
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn stream_store_plain<T: Avx512Element>(src: &[f32], dst: &mut [T]) -> usize {
    // SAFETY: the caller checked the features this body needs.
    unsafe { stream_store_body::<T, false>(src, dst) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
unsafe fn stream_store_hardware<T: Avx512Element>(src: &[f32], dst: &mut [T]) -> usize {
    // SAFETY: the caller checked the features this body needs.
    unsafe { stream_store_body::<T, true>(src, dst) }
}

/// # Safety
/// AVX-512F/BW are available, and AVX512-BF16/DQ too when `HW`.
#[inline(always)]
unsafe fn stream_store_body<T: Avx512Element, const HW: bool>(src: &[f32], dst: &mut [T]) -> usize {
    let n = src.len().min(dst.len());
    if !(dst.as_ptr() as usize).is_multiple_of(WIDTH * size_of::<T>()) || n < WIDTH {
        return 0;
    }
    let full = n - n % WIDTH;
    let mut flushed = Flushed::default();
    // SAFETY: the caller's contract.
    unsafe { stream_vectors::<T, HW>(&src[..full], dst, &mut flushed) };
    if HW && flushed.any() {
        // A subnormal was flushed: the whole run again with the bit operation (`src` is unchanged).
        // SAFETY: the caller's contract.
        unsafe { stream_vectors::<T, false>(&src[..full], dst, &mut flushed) };
    }
    full
}

/// Streams `src` (whole vectors of 16) into the start of `dst`, aligned to 16 values.
///
/// # Safety
/// As [`stream_store_body`]; `dst` holds `src.len()` values.
#[inline(always)]
unsafe fn stream_vectors<T: Avx512Element, const HW: bool>(src: &[f32], dst: &mut [T], flushed: &mut Flushed) {
    let mut i = 0;
    while i < src.len() {
        // SAFETY: `i + 16 <= src.len() <= dst.len()`; `dst` starts aligned to 16 values and each
        // store advances by 16 of them, so every store is aligned.
        unsafe { T::stream16::<HW>(dst.as_mut_ptr().add(i), _mm512_loadu_ps(src.as_ptr().add(i)), flushed) };
        i += WIDTH;
    }
}

/// Rounds each value to bf16 and back, in place, with `vcvtneps2bf16`: the portable bits.
///
/// # Safety
/// [`hardware_bf16`] is true.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
pub(crate) unsafe fn round_bf16_in_place(v: &mut [f32]) {
    let n = v.len();
    let full = n - n % WIDTH;
    let mut i = 0;
    while i < full {
        // SAFETY: `i + 16 <= n`; the features are enabled here.
        unsafe {
            let p = v.as_mut_ptr().add(i);
            let value = _mm512_loadu_ps(p);
            // In place, so each vector is checked before it is written.
            let mut flushed = Flushed::default();
            let mut rounded = bf16::round16::<true>(value, &mut flushed);
            if flushed.any() {
                rounded = bf16::round16::<false>(value, &mut flushed);
            }
            _mm512_storeu_ps(p, rounded);
        }
        i += WIDTH;
    }
    for x in &mut v[full..] {
        *x = f32::from_bits(u32::from(crate::element::bf16_bits(*x)) << 16);
    }
}

/// `Σ v` (`center` `None`) or `Σ (v − center)²` over `values` in f64 with the lanes of
/// `gated::lane_sum`, operation for operation (a subtract, a multiply, an add: no fused
/// multiply-add): four 8-lane accumulators hold its 32 lanes, reduced in its pairwise order, then
/// the tail in order. The same bits.
///
/// # Safety
/// [`available`] is true.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn lane_sum_f64(values: &[f32], center: Option<f64>) -> f64 {
    const CHUNK: usize = 32;
    let full = values.len() - values.len() % CHUNK;
    let c = _mm512_set1_pd(center.unwrap_or(0.0));
    let mut acc = [_mm512_setzero_pd(); 4];
    let mut i = 0;
    while i < full {
        for (k, lane) in acc.iter_mut().enumerate() {
            // SAFETY: `i + 32 <= len`, so the 8 values at `i + 8k` are readable.
            let v = _mm512_cvtps_pd(unsafe { _mm256_loadu_ps(values.as_ptr().add(i + 8 * k)) });
            let term = if center.is_some() {
                let d = _mm512_sub_pd(v, c);
                _mm512_mul_pd(d, d)
            } else {
                v
            };
            *lane = _mm512_add_pd(*lane, term);
        }
        i += CHUNK;
    }
    // Lanes i += i + 16, then i += i + 8, 4, 2, 1.
    let half = _mm512_add_pd(_mm512_add_pd(acc[0], acc[2]), _mm512_add_pd(acc[1], acc[3]));
    let quarter = _mm256_add_pd(_mm512_castpd512_pd256(half), _mm512_extractf64x4_pd::<1>(half));
    let pair = _mm_add_pd(_mm256_castpd256_pd128(quarter), _mm256_extractf128_pd::<1>(quarter));
    let total = _mm_cvtsd_f64(pair) + _mm_cvtsd_f64(_mm_unpackhi_pd(pair, pair));
    values[full..].iter().fold(total, |acc, &v| {
        let v = f64::from(v);
        acc + match center {
            Some(center) => (v - center) * (v - center),
            None => v,
        }
    })
}

/// Packs the values of `values` that are not ±0 (NaN included) into the start of `packed`, their
/// indices into `indices`, in order; returns how many. Both outputs need room for `values.len() + 16`
/// (each group of 16 stores a whole register).
///
/// # Safety
/// [`available`] is true.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_nonzero(values: &[f32], packed: &mut [f32], indices: &mut [u32]) -> usize {
    assert!(packed.len() >= values.len() + WIDTH && indices.len() >= values.len() + WIDTH, "room to pack");
    let full = values.len() - values.len() % WIDTH;
    let (zero, step) = (_mm512_setzero_ps(), _mm512_set1_epi32(WIDTH as i32));
    let mut index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut n = 0;
    let mut i = 0;
    while i < full {
        // SAFETY: `i + 16 <= len` values are read; `n <= i`, so `n + 16 <= len + 16` fit both outputs.
        unsafe {
            let v = _mm512_loadu_ps(values.as_ptr().add(i));
            let keep = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(v, zero);
            _mm512_storeu_ps(packed.as_mut_ptr().add(n), _mm512_maskz_compress_ps(keep, v));
            _mm512_storeu_epi32(indices.as_mut_ptr().add(n).cast(), _mm512_maskz_compress_epi32(keep, index));
            n += keep.count_ones() as usize;
        }
        index = _mm512_add_epi32(index, step);
        i += WIDTH;
    }
    for (j, &v) in values.iter().enumerate().skip(full) {
        if v != 0.0 {
            packed[n] = v;
            indices[n] = j as u32;
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that stress every rounding rule: ordinary, halfway bf16 cases, subnormals, huge
    /// values (a row of them overflows the f32 sum), infinities and NaN.
    fn awkward(n: usize, seed: u32, huge: bool) -> Vec<f32> {
        let specials = [
            0.0,
            -0.0,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            1e-40,
            -f32::MIN_POSITIVE,
            65504.0,
            f32::from_bits(0x7f80_0001),
        ];
        (0..n)
            .map(|i| {
                let k = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                if huge {
                    return 3e37 * if k.is_multiple_of(2) { 1.0 } else { -1.0 };
                }
                match k % 97 {
                    0 => specials[(k / 97) as usize % specials.len()],
                    1 if seed.is_multiple_of(5) => f32::INFINITY,
                    2 if seed.is_multiple_of(7) => f32::NAN,
                    _ => ((k % 20_011) as f32 / 10_005.5 - 1.0) * 3.0,
                }
            })
            .collect()
    }

    /// The explicit row variants this CPU runs for `T`: the AVX-512F/BW rows, and for bf16 the
    /// AVX512-BF16 ones where the CPU has them.
    fn variants<T: Avx512Element>() -> Vec<(&'static str, RmsNormRow<T>, FusedRow<T>)> {
        let mut variants = vec![("avx512", rms_plain::<T> as RmsNormRow<T>, fused_plain::<T> as FusedRow<T>)];
        if T::HARDWARE_ROUNDING {
            if hardware_bf16() {
                variants.push(("avx512bf16", rms_hardware::<T>, fused_hardware::<T>));
            } else {
                eprintln!("skipped the AVX512-BF16 rows: this CPU has no AVX512-BF16");
            }
        }
        variants
    }

    fn check<T: Avx512Element + PartialEq + std::fmt::Debug>(convert: impl Fn(&[f32]) -> Vec<T>) {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512F, so only the portable rows run here");
            return;
        }
        for (variant, rms, fused) in variants::<T>() {
            check_rows(variant, rms, fused, &convert);
        }
    }

    fn check_rows<T: Avx512Element + PartialEq + std::fmt::Debug>(
        variant: &str,
        rms: RmsNormRow<T>,
        fused: FusedRow<T>,
        convert: &impl Fn(&[f32]) -> Vec<T>,
    ) {
        for n in (1..=300).chain([4096, 4096 + 17]) {
            // A zero residual makes the fused sums x itself, subnormals included.
            for (seed, huge, zero_residual) in
                [(1, false, false), (5, false, false), (7, false, false), (11, true, false), (13, false, true)]
            {
                let x = convert(&awkward(n, seed, huge));
                let r = convert(&if zero_residual { vec![0.0; n] } else { awkward(n, seed + 3, false) });
                let w = convert(&awkward(n, seed + 9, false));
                for weight in [None, Some(w.as_slice())] {
                    let mut expected = x.clone();
                    rows::rms_norm_row_portable(&x, weight, 1e-6, &mut expected);
                    for stream in [false, true] {
                        // A 64-byte aligned output, so the streaming stores run.
                        let mut storage = vec![T::zeroed(); n + 64];
                        let start = storage.as_ptr().align_offset(64);
                        let got = &mut storage[start..start + n];
                        rms(&x, weight, 1e-6, got, stream);
                        let what =
                            format!("{variant} rms_norm n {n} seed {seed} weight {} stream {stream}", weight.is_some());
                        assert_eq!(bits(got), bits(&expected), "{what}");
                    }

                    let (mut ex, mut er) = (x.clone(), r.clone());
                    let (mut gx, mut gr) = (x.clone(), r.clone());
                    rows::fused_row_portable(RowOut::InPlace(&mut ex), &mut er, weight, 1e-6);
                    fused(RowOut::InPlace(&mut gx), &mut gr, weight, 1e-6);
                    assert_eq!(bits(&gr), bits(&er), "{variant} fused residual n {n} seed {seed}");
                    let what = format!("{variant} fused output n {n} seed {seed} weight {}", weight.is_some());
                    assert_eq!(bits(&gx), bits(&ex), "{what}");
                    // Into another row: the same norm and residual, x unchanged.
                    let (mut sr, mut out) = (r.clone(), vec![T::zeroed(); n]);
                    fused(RowOut::Separate { x: &x, out: &mut out }, &mut sr, weight, 1e-6);
                    assert_eq!(bits(&out), bits(&ex), "{what}, into another row");
                    assert_eq!(bits(&sr), bits(&er), "{what}, into another row: residual");
                    let (mut pr, mut pout) = (r.clone(), vec![T::zeroed(); n]);
                    rows::fused_row_portable(RowOut::Separate { x: &x, out: &mut pout }, &mut pr, weight, 1e-6);
                    assert_eq!(bits(&pout), bits(&ex), "{what}, portable into another row");
                }
            }
        }
    }

    /// f32 values covering every sign and exponent (all 65536 top halves) with the low halves that
    /// decide bf16 rounding (exact, just below, at and above halfway, the largest) and a few others.
    fn rounding_cases() -> Vec<f32> {
        let lows = [0x0000u32, 0x0001, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xc123, 0xffff];
        (0..=0xffffu32).flat_map(|high| lows.map(|low| f32::from_bits(high << 16 | low))).collect()
    }

    #[test]
    fn hardware_bf16_rounding_gives_the_bit_operations_bits_on_every_exponent() {
        if !hardware_bf16() {
            eprintln!("skipped: this CPU has no AVX512-BF16, so bf16 is rounded by the bit operation only");
            return;
        }
        let values = rounding_cases();
        let expected: Vec<u16> = values.iter().map(|&v| crate::element::bf16_bits(v)).collect();
        // Lengths that leave a tail, and offsets that put subnormals and ordinary values in one vector.
        for skip in [0, 5] {
            let src = &values[skip..];
            let mut got = vec![bf16::ZERO; src.len()];
            // SAFETY: `hardware_bf16` checked the CPU.
            unsafe { store_bf16(src, &mut got) };
            for (i, (g, e)) in got.iter().zip(&expected[skip..]).enumerate() {
                assert_eq!(g.to_bits(), *e, "store of {:#010x}", src[i].to_bits());
            }
            let mut rounded = src.to_vec();
            // SAFETY: as above.
            unsafe { round_bf16_in_place(&mut rounded) };
            for (i, (r, e)) in rounded.iter().zip(&expected[skip..]).enumerate() {
                assert_eq!(r.to_bits(), u32::from(*e) << 16, "round of {:#010x}", src[i].to_bits());
            }
        }
        // The generic bf16 conversions take the hardware form here, with the same bits.
        let mut stored = vec![bf16::ZERO; values.len()];
        bf16::store(&values, &mut stored);
        assert!(stored.iter().zip(&expected).all(|(s, e)| s.to_bits() == *e));
    }

    /// The values' bits, every NaN as one canonical NaN: Rust (like IEEE 754) leaves the payload of
    /// a NaN produced by arithmetic unspecified, and which operand's payload x86 propagates depends on
    /// the operand order the compiler picked.
    fn bits<T: CpuElement>(values: &[T]) -> Vec<u32> {
        let mut widened = vec![0f32; values.len()];
        T::load(values, &mut widened);
        widened.iter().map(|v| if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() }).collect()
    }

    #[test]
    fn f32_rows_match_the_portable_rows_bit_for_bit() {
        check::<f32>(<[f32]>::to_vec);
    }

    #[test]
    fn f16_rows_match_the_portable_rows_bit_for_bit() {
        check::<half::f16>(|v| v.iter().map(|&x| half::f16::from_f32(x)).collect());
    }

    #[test]
    fn bf16_rows_match_the_portable_rows_bit_for_bit() {
        check::<bf16>(|v| v.iter().map(|&x| bf16::from_f32(x)).collect());
    }
}
