//! Element types and their conversions.
//!
//! The 8-bit formats are OCP FP8 `E4M3FN` (4 exponent bits, 3 mantissa bits, no infinities, one NaN
//! per sign, largest finite 448) and `E5M2` (IEEE-style, largest finite 57344), backed by the
//! `float8` crate's types, and `i8`. Converting to them rounds to nearest-even and *saturates*:
//! anything beyond the largest finite value, infinities included, becomes that value with its sign;
//! NaN stays NaN (for `i8`, NaN becomes 0). These are the conversions CUDA's `__NV_SATFINITE` mode
//! performs, and the ones quantization kernels use.
//!
//! Every NaN, whatever its sign and payload, converts to one code per format, [`FP8_NAN`] (`0x7f`:
//! sign clear, exponent and mantissa all ones), in every provider: a NaN's sign and payload after
//! arithmetic are unspecified (IEEE 754 leaves them to the hardware and the compiler), so keeping
//! them would make the bits of a quantized NaN depend on where it was computed. `0x7f` is also what
//! NVIDIA's hardware conversion (`cvt.rn.satfinite.e4m3x2.f32`) writes for a NaN.

use std::fmt;
use std::str::FromStr;

pub use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

/// The element type of a tensor.
///
/// `F64` exists for references: native ops accept it, kernels do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (the `half` crate's `f16`).
    F16,
    /// bfloat16 (the `half` crate's `bf16`).
    BF16,
    /// IEEE binary64, for references.
    F64,
    /// OCP FP8 E4M3FN ([`F8E4M3`]): finite only, largest 448.
    F8E4M3FN,
    /// OCP FP8 E5M2 ([`F8E5M2`]): largest finite 57344.
    F8E5M2,
    /// Signed 8-bit integer.
    I8,
    /// Signed 64-bit integer (token positions, indices). Values beyond 2^53 do not survive the
    /// `f64` conversions of the reference paths.
    I64,
}

/// A dtype name that is not one of the known spellings.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (known: f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8, i64)")]
pub struct UnknownDType(pub String);

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F16, DType::BF16, DType::F64, DType::F8E4M3FN, DType::F8E5M2, DType::I8, DType::I64];

    /// The dtypes models compute in (norms and activations take these): f32, f16, bf16, f64.
    pub const COMPUTE: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

    /// The 8-bit floating-point dtypes quantization writes.
    pub const FP8: [DType; 2] = [DType::F8E4M3FN, DType::F8E5M2];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::F8E4M3FN | DType::F8E5M2 | DType::I8 => 1,
        }
    }

    /// The text-format spelling (`f32`, `f16`, `bf16`, `f64`, `f8e4m3fn`, `f8e5m2`, `i8`, `i64`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::F8E4M3FN => "f8e4m3fn",
            DType::F8E5M2 => "f8e5m2",
            DType::I8 => "i8",
            DType::I64 => "i64",
        }
    }

    /// Rounds `value` to this dtype (nearest-even, saturating for the 8-bit and integer types; NaN
    /// stays NaN except in the integer types, where it is 0) and widens it back to `f64`.
    pub fn round(self, value: f64) -> f64 {
        match self {
            DType::F32 => value as f32 as f64,
            DType::F16 => <f16 as Element>::from_f64(value).to_f64(),
            DType::BF16 => <bf16 as Element>::from_f64(value).to_f64(),
            DType::F64 => value,
            DType::F8E4M3FN => <F8E4M3 as Element>::from_f64(value).to_f64(),
            DType::F8E5M2 => <F8E5M2 as Element>::from_f64(value).to_f64(),
            DType::I8 => <i8 as Element>::from_f64(value).to_f64(),
            DType::I64 => <i64 as Element>::from_f64(value).to_f64(),
        }
    }

    /// The dtype native ops compute in: `F64` for `F64` inputs, `F32` otherwise.
    pub fn compute_dtype(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    /// Whether models compute in this dtype (one of [`DType::COMPUTE`]); the 8-bit types only store
    /// quantized values.
    pub fn is_compute(self) -> bool {
        DType::COMPUTE.contains(&self)
    }

    /// The largest finite value of an 8-bit floating-point dtype (448 for E4M3FN, 57344 for E5M2).
    pub fn fp8_max(self) -> Option<f64> {
        match self {
            DType::F8E4M3FN => Some(448.0),
            DType::F8E5M2 => Some(57344.0),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = UnknownDType;

    fn from_str(s: &str) -> Result<DType, UnknownDType> {
        match s {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::BF16),
            "f64" => Ok(DType::F64),
            "f8e4m3fn" => Ok(DType::F8E4M3FN),
            "f8e5m2" => Ok(DType::F8E5M2),
            "i8" => Ok(DType::I8),
            "i64" => Ok(DType::I64),
            _ => Err(UnknownDType(s.to_owned())),
        }
    }
}

/// A Rust element type that backs one [`DType`].
///
/// Conversions from `f64` and `f32` round to nearest-even and keep NaN.
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The dtype this type stores.
    const DTYPE: DType;
    /// Widens to `f64` (exact).
    fn to_f64(self) -> f64;
    /// Rounds an `f64` to this type.
    fn from_f64(value: f64) -> Self;
    /// Widens to `f32` (exact for every type but `f64`, and `i64` beyond 2^24).
    fn to_f32(self) -> f32;
    /// Rounds an `f32` to this type.
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(value: f64) -> f32 {
        value as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> f32 {
        value
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(value: f64) -> f64 {
        value
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(value: f32) -> f64 {
        value as f64
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(value: f64) -> f16 {
        f16::from_f32(f32_round_to_odd(value))
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> f16 {
        f16::from_f32(value)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(value: f64) -> bf16 {
        bf16::from_f32(f32_round_to_odd(value))
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> bf16 {
        bf16::from_f32(value)
    }
}

/// The code every NaN converts to in both 8-bit float formats (sign clear, all other bits set):
/// one canonical NaN per format, the same in every provider. A NaN's sign and payload after
/// arithmetic are unspecified (IEEE 754 leaves them to the hardware and the compiler), so keeping
/// them would make a quantized NaN's bits depend on where it was computed; `0x7f` is also what
/// NVIDIA's hardware conversion writes for a NaN.
pub const FP8_NAN: u8 = 0x7f;

impl Element for F8E4M3 {
    const DTYPE: DType = DType::F8E4M3FN;
    fn to_f64(self) -> f64 {
        F8E4M3::to_f64(&self)
    }
    fn from_f64(value: f64) -> F8E4M3 {
        if value.is_nan() { F8E4M3::from_bits(FP8_NAN) } else { F8E4M3::from_f64(value) }
    }
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(&self)
    }
    fn from_f32(value: f32) -> F8E4M3 {
        if value.is_nan() { F8E4M3::from_bits(FP8_NAN) } else { F8E4M3::from_f32(value) }
    }
}

impl Element for F8E5M2 {
    const DTYPE: DType = DType::F8E5M2;
    fn to_f64(self) -> f64 {
        F8E5M2::to_f64(&self)
    }
    fn from_f64(value: f64) -> F8E5M2 {
        if value.is_nan() { F8E5M2::from_bits(FP8_NAN) } else { F8E5M2::from_f64(value) }
    }
    fn to_f32(self) -> f32 {
        F8E5M2::to_f32(&self)
    }
    fn from_f32(value: f32) -> F8E5M2 {
        if value.is_nan() { F8E5M2::from_bits(FP8_NAN) } else { F8E5M2::from_f32(value) }
    }
}

/// Implements [`Element`] for a signed integer type: conversions from floats round to the nearest
/// integer, ties to even, and saturate to the type's range (`as` saturates and maps NaN to 0).
macro_rules! integer_element {
    ($t:ty, $dtype:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(value: f64) -> $t {
                value.round_ties_even() as $t
            }
            fn to_f32(self) -> f32 {
                self as f32
            }
            fn from_f32(value: f32) -> $t {
                value.round_ties_even() as $t
            }
        }
    };
}

integer_element!(i8, I8);
// Exact in f64 up to 2^53 and in f32 up to 2^24 in magnitude.
integer_element!(i64, I64);

/// Narrows to f32 rounding to odd: truncate, then set the last bit if anything was lost.
///
/// Rounding that result to nearest-even in a format of at most 22 significand bits (f16, bf16) equals
/// rounding the f64 directly, while going through a nearest-even f32 could round twice.
fn f32_round_to_odd(value: f64) -> f32 {
    let nearest = value as f32;
    let exact = nearest as f64 == value;
    if exact || !nearest.is_finite() || value.is_nan() {
        return nearest;
    }
    let bits = nearest.to_bits();
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    let truncated = if (nearest as f64).abs() > value.abs() { bits - 1 } else { bits };
    f32::from_bits(truncated | 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for dtype in DType::ALL {
            assert_eq!(dtype.name().parse::<DType>(), Ok(dtype));
        }
        let err = "int8".parse::<DType>().unwrap_err();
        assert_eq!(err.to_string(), "unknown dtype `int8` (known: f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8, i64)");
    }

    #[test]
    fn rounding_is_nearest_even_and_keeps_nan() {
        // 1 + 2^-8 is exactly halfway between two bf16 values; ties go to the even one (1.0).
        assert_eq!(DType::BF16.round(1.0 + 2f64.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 is halfway too; the even neighbour is 1 + 2^-6.
        assert_eq!(DType::BF16.round(1.0 + 3.0 * 2f64.powi(-8)), 1.0 + 2f64.powi(-6));
        assert_eq!(DType::F16.round(1.0 + 2f64.powi(-11)), 1.0);
        assert!(DType::F16.round(f64::NAN).is_nan());
        assert!(DType::BF16.round(f64::NAN).is_nan());
        assert!(DType::F32.round(f64::NAN).is_nan());
        assert_eq!(DType::F16.round(70000.0), f64::INFINITY);
        // Rounding straight from f64, not through f32 (which would round twice and tie to even).
        let just_above_half = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(DType::F16.round(just_above_half), 1.0 + 2f64.powi(-10));
        let just_above_half = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(DType::BF16.round(just_above_half), 1.0 + 2f64.powi(-7));
    }

    /// The value of an 8-bit float code, decoded from its fields (independently of `float8`).
    fn decode(code: u8, exponent_bits: u32, e4m3fn: bool) -> f64 {
        let mantissa_bits = 7 - exponent_bits;
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exponent = ((code >> mantissa_bits) & ((1 << exponent_bits) - 1)) as i32;
        let mantissa = (code & ((1 << mantissa_bits) - 1)) as f64;
        let max_exponent = (1 << exponent_bits) - 1;
        let bias = (1 << (exponent_bits - 1)) - 1;
        let scale = (1u32 << mantissa_bits) as f64;
        if e4m3fn && exponent == max_exponent && mantissa == scale - 1.0 {
            return f64::NAN;
        }
        if !e4m3fn && exponent == max_exponent {
            return if mantissa == 0.0 { sign * f64::INFINITY } else { f64::NAN };
        }
        if exponent == 0 {
            return sign * mantissa / scale * 2f64.powi(1 - bias);
        }
        sign * (1.0 + mantissa / scale) * 2f64.powi(exponent - bias)
    }

    /// Every code of an 8-bit float format: decoding matches the fields, every finite value encodes
    /// back to its code, midpoints round to the even neighbour and their neighbours to the nearest,
    /// overflow saturates and NaN stays NaN.
    fn check_all_codes(dtype: DType, exponent_bits: u32) {
        let e4m3fn = dtype == DType::F8E4M3FN;
        let from_bits = |code: u8| match dtype {
            DType::F8E4M3FN => F8E4M3::from_bits(code).to_f64(),
            _ => F8E5M2::from_bits(code).to_f64(),
        };
        let encode = |value: f64| match dtype {
            DType::F8E4M3FN => <F8E4M3 as Element>::from_f64(value).to_bits(),
            _ => <F8E5M2 as Element>::from_f64(value).to_bits(),
        };
        let max = dtype.fp8_max().unwrap();
        let mut finite = Vec::new();
        for code in 0..=255u8 {
            let expected = decode(code, exponent_bits, e4m3fn);
            let got = from_bits(code);
            if expected.is_nan() {
                assert!(got.is_nan(), "{dtype} code {code:#04x} decodes to NaN, got {got}");
                assert!(is_nan_code(code, dtype), "{dtype}: {code:#04x} is a NaN code");
                assert_eq!(encode(got), FP8_NAN, "{dtype}: NaN encodes to the canonical NaN");
                continue;
            }
            assert_eq!(got.to_bits(), expected.to_bits(), "{dtype} code {code:#04x}");
            if expected.is_infinite() {
                assert_eq!(from_bits(encode(expected)), expected.signum() * max, "{dtype}: infinity saturates");
                continue;
            }
            assert_eq!(encode(expected), code, "{dtype}: {expected} encodes back to {code:#04x}");
            assert_eq!(dtype.round(expected).to_bits(), expected.to_bits());
            if code < 0x80 {
                finite.push((expected, code));
            }
        }
        finite.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(finite.last().unwrap().0, max, "{dtype}: the largest finite value");
        for pair in finite.windows(2) {
            let [(low, low_code), (high, high_code)] = [pair[0], pair[1]];
            let mid = (low + high) / 2.0;
            let even = if low_code % 2 == 0 { low_code } else { high_code };
            for sign in [1.0, -1.0] {
                let sign_bit = if sign < 0.0 { 0x80 } else { 0 };
                assert_eq!(encode(sign * mid), even | sign_bit, "{dtype}: the tie {} goes to even", sign * mid);
                assert_eq!(encode(sign * mid.next_up()), high_code | sign_bit, "{dtype}: above {mid}");
                assert_eq!(encode(sign * mid.next_down()), low_code | sign_bit, "{dtype}: below {mid}");
            }
        }
        for beyond in [max.next_up(), max * 1.0625, max * 4.0, f64::MAX, f64::INFINITY] {
            assert_eq!(dtype.round(beyond), max, "{dtype}: {beyond} saturates");
            assert_eq!(dtype.round(-beyond), -max, "{dtype}: -{beyond} saturates");
        }
        let smallest = finite[1].0;
        assert_eq!(encode(smallest / 2.0), 0, "{dtype}: half the smallest subnormal ties to zero");
        assert_eq!(encode(-smallest / 4.0), 0x80, "{dtype}: underflow keeps the sign");
        assert!(dtype.round(f64::NAN).is_nan());
        // Every NaN, whatever its sign and payload, in f64 and in f32, is the one canonical code.
        let nans64 =
            [f64::NAN, -f64::NAN, f64::from_bits(0x7ff0_0000_0000_0001), f64::from_bits(0xfff4_0000_0000_0000)];
        let nans32 = [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffe0_0001),
            f32::from_bits(0x7fe0_0000),
        ];
        for nan in nans64 {
            assert_eq!(encode(nan), FP8_NAN, "{dtype}: {:#018x}", nan.to_bits());
        }
        for nan in nans32 {
            let code = match dtype {
                DType::F8E4M3FN => <F8E4M3 as Element>::from_f32(nan).to_bits(),
                _ => <F8E5M2 as Element>::from_f32(nan).to_bits(),
            };
            assert_eq!(code, FP8_NAN, "{dtype}: {:#010x}", nan.to_bits());
        }
    }

    /// Whether `code` is a NaN of the 8-bit float `dtype`.
    fn is_nan_code(code: u8, dtype: DType) -> bool {
        match dtype {
            DType::F8E4M3FN => code & 0x7f == 0x7f,
            _ => code & 0x7f > 0x7c,
        }
    }

    #[test]
    fn every_f8e4m3fn_code() {
        check_all_codes(DType::F8E4M3FN, 4);
    }

    #[test]
    fn every_f8e5m2_code() {
        check_all_codes(DType::F8E5M2, 5);
    }

    #[test]
    fn i8_rounds_to_even_and_saturates() {
        for code in i8::MIN..=i8::MAX {
            assert_eq!(<i8 as Element>::from_f64(code as f64), code);
            assert_eq!(<i8 as Element>::from_f32(code as f32 + 0.25), code);
        }
        assert_eq!(DType::I8.round(2.5), 2.0);
        assert_eq!(DType::I8.round(3.5), 4.0);
        assert_eq!(DType::I8.round(-2.5), -2.0);
        assert_eq!(DType::I8.round(127.6), 127.0);
        assert_eq!(DType::I8.round(-1e30), -128.0);
        assert_eq!(DType::I8.round(f64::NAN), 0.0);
        assert_eq!(DType::I8.size_in_bytes(), 1);
    }

    #[test]
    fn i64_keeps_positions_and_saturates() {
        for value in [0i64, 1, -1, 4095, 1 << 40, -(1 << 53), 1 << 53] {
            assert_eq!(<i64 as Element>::from_f64(value as f64), value);
            assert_eq!(<i64 as Element>::from_f64(value as f64).to_f64(), value as f64);
        }
        assert_eq!(DType::I64.round(2.5), 2.0);
        assert_eq!(DType::I64.round(-3.5), -4.0);
        assert_eq!(<i64 as Element>::from_f64(1e300), i64::MAX);
        assert_eq!(<i64 as Element>::from_f64(f64::NEG_INFINITY), i64::MIN);
        assert_eq!(DType::I64.round(f64::NAN), 0.0);
        assert_eq!(DType::I64.size_in_bytes(), 8);
        assert!(!DType::I64.is_compute() && DType::I64.fp8_max().is_none());
    }

    #[test]
    fn only_the_wide_types_are_computed_in() {
        let compute: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_compute()).collect();
        assert_eq!(compute, DType::COMPUTE);
        assert_eq!(DType::F8E4M3FN.compute_dtype(), DType::F32);
        assert_eq!(DType::F32.fp8_max(), None);
    }
}
