//! Element types and their conversions.

use std::fmt;
use std::str::FromStr;

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
}

/// A dtype name that is not one of `f32`, `f16`, `bf16`, `f64`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (known: f32, f16, bf16, f64)")]
pub struct UnknownDType(pub String);

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 => 8,
        }
    }

    /// The text-format spelling (`f32`, `f16`, `bf16`, `f64`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
        }
    }

    /// Rounds `value` to this dtype (nearest-even; NaN stays NaN) and widens it back to `f64`.
    pub fn round(self, value: f64) -> f64 {
        match self {
            DType::F32 => value as f32 as f64,
            DType::F16 => <f16 as Element>::from_f64(value).to_f64(),
            DType::BF16 => <bf16 as Element>::from_f64(value).to_f64(),
            DType::F64 => value,
        }
    }

    /// The dtype native ops compute in: `F64` for `F64` inputs, `F32` otherwise.
    pub fn compute_dtype(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            DType::F32 | DType::F16 | DType::BF16 => DType::F32,
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
    /// Widens to `f32` (exact for every type but `f64`).
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
        assert_eq!(err.to_string(), "unknown dtype `int8` (known: f32, f16, bf16, f64)");
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
}
