//! The element types the CPU kernels store, as [`CpuElement`]s: f32, f16 and bf16, with their
//! AVX-512 rows and the AVX512-BF16 rounding where the CPU has them. Above both the element trait
//! (`element`) and the explicit rows (`avx512`), which is generic over it; nothing names this
//! module, the kernels reach the implementations through the trait.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::element::{CpuElement, bf16_bits};
#[cfg(target_arch = "x86_64")]
use crate::element::{FusedRow, RmsNormRow};

/// The explicit-row methods of [`CpuElement`] for a type with AVX-512 rows.
macro_rules! explicit_rows {
    () => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        fn simd_rms_norm_row() -> Option<RmsNormRow<Self>> {
            crate::row_path().is_avx512().then(crate::avx512::rms_norm_row_fn::<Self>).flatten()
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        fn simd_fused_row() -> Option<FusedRow<Self>> {
            crate::row_path().is_avx512().then(crate::avx512::fused_row_fn::<Self>).flatten()
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        fn store_streaming(src: &[f32], dst: &mut [Self]) {
            let done = if crate::row_path().is_avx512() { crate::avx512::stream_store(src, dst) } else { 0 };
            Self::store(&src[done..], &mut dst[done..]);
        }
    };
}

impl CpuElement for f32 {
    explicit_rows!();
    #[inline(always)]
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn widen<'a>(src: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        src
    }

    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn update_as_f32(row: &mut [f32], _: &mut [f32], f: impl FnOnce(&mut [f32])) {
        f(row);
    }

    #[inline(always)]
    fn round_in_place(_: &mut [f32]) {}

    const ROUNDS_PRODUCTS: bool = true;

    #[inline(always)]
    fn store_normalized(s: &[f32], rstd: f32, weight: Option<&[f32]>, out: &mut [f32]) {
        match weight {
            None => out.iter_mut().zip(s).for_each(|(o, v)| *o = v * rstd),
            Some(weight) => out.iter_mut().zip(s).zip(weight).for_each(|((o, v), w)| *o = (v * rstd) * w),
        }
    }
}

impl CpuElement for f16 {
    explicit_rows!();

    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl CpuElement for bf16 {
    explicit_rows!();
    #[inline(always)]
    fn load(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }

    #[inline(always)]
    fn store(src: &[f32], dst: &mut [bf16]) {
        #[cfg(target_arch = "x86_64")]
        if hardware_bf16() {
            // SAFETY: `hardware_bf16` checked the CPU.
            return unsafe { crate::avx512::store_bf16(src, dst) };
        }
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bf16_bits(*s));
        }
    }

    const ROUNDS_PRODUCTS: bool = true;

    #[inline(always)]
    fn round_product(v: f32) -> f32 {
        // Nearest-even in the 32-bit lanes (no narrowing, so the loops vectorize). A NaN product of
        // two bf16 values (a NaN operand, quieted, or inf · 0) has no bit below the 16 kept, so the
        // rounding add leaves it NaN: no separate NaN case, unlike `bf16_bits`.
        let bits = v.to_bits();
        f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
    }

    #[inline(always)]
    fn pre_round(v: f32) -> f32 {
        // `round_product`'s add without its cut. A NaN with nothing below the kept bits (every
        // arithmetic result on bf16 values: quiet, its payload from an operand or the default
        // one) stays the same NaN; a finite value past bf16's largest carries into infinity.
        let bits = v.to_bits();
        f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)))
    }

    #[inline(always)]
    fn update_as_f32_pre_rounded(row: &mut [bf16], scratch: &mut [f32], f: impl FnOnce(&mut [f32])) {
        let values = &mut scratch[..row.len()];
        Self::load(row, values);
        f(values);
        for (d, s) in row.iter_mut().zip(values.iter()) {
            *d = bf16::from_bits((s.to_bits() >> 16) as u16);
        }
    }

    #[inline(always)]
    fn round_in_place(v: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if hardware_bf16() {
            // SAFETY: `hardware_bf16` checked the CPU.
            return unsafe { crate::avx512::round_bf16_in_place(v) };
        }
        for x in v {
            *x = f32::from_bits((bf16_bits(*x) as u32) << 16);
        }
    }

    #[inline(always)]
    fn store_normalized(s: &[f32], rstd: f32, weight: Option<&[f32]>, out: &mut [bf16]) {
        match weight {
            None => out.iter_mut().zip(s).for_each(|(o, v)| *o = bf16::from_bits(bf16_bits(v * rstd))),
            Some(weight) => out.iter_mut().zip(s).zip(weight).for_each(|((o, v), w)| {
                let y = f32::from_bits((bf16_bits(v * rstd) as u32) << 16);
                *o = bf16::from_bits(bf16_bits(y * w));
            }),
        }
    }
}

/// Whether bf16 slices are rounded by the AVX512-BF16 conversion ([`crate::avx512::store_bf16`]):
/// the explicit rows run ([`crate::row_path`]) and the CPU has it. The same bits as the loops here.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn hardware_bf16() -> bool {
    static HARDWARE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HARDWARE.get_or_init(|| crate::row_path().is_avx512() && crate::avx512::hardware_bf16())
}
