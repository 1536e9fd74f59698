//! Rotary frequencies and their scaling: the cos/sin caches a checkpoint's `rope_theta` and
//! `rope_scaling` ask for (linear, dynamic NTK, Llama 3, YaRN), in the layout `rotary_embedding`
//! takes (`[max_position, rotary_dim]`, cos then sin per position), computed in f64 and rounded
//! once to the cache's dtype.

use ir_core::{DType, Tensor, TensorError};

use crate::error::{LayerError, RopeScalingError};

/// How a checkpoint stretches its rotary frequencies past the context it was trained on (Hugging
/// Face's `rope_scaling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (`"linear"`).
    Linear {
        /// The stretch.
        factor: f64,
    },
    /// A larger base for a cache of `original_max_position · factor` positions (`"dynamic"`, as a
    /// cache built once for the longest context `L`): `base · (factor · L / original − (factor −
    /// 1))^(d / (d − 2))`, that is `base · (factor² − factor + 1)^(d / (d − 2))`.
    DynamicNtk {
        /// The stretch.
        factor: f64,
        /// The context the checkpoint was trained on.
        original_max_position: usize,
    },
    /// Llama 3's: frequencies whose wavelength is shorter than `original_max_position /
    /// high_freq_factor` are kept, longer than `original_max_position / low_freq_factor` divided by
    /// `factor`, and those between blended linearly in the wavelength's inverse (`"llama3"`).
    Llama3 {
        /// The stretch of the low frequencies.
        factor: f64,
        /// Wavelengths past `original_max_position / low_freq_factor` are stretched.
        low_freq_factor: f64,
        /// Wavelengths under `original_max_position / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the checkpoint was trained on.
        original_max_position: usize,
    },
    /// YaRN: the frequencies interpolated (divided by `factor`) below the correction range and
    /// extrapolated (kept) above it, ramped linearly between, and cos and sin scaled by
    /// `attention_factor` ([`RopeScaling::yarn_attention_factor`] by default) (`"yarn"`).
    Yarn {
        /// The stretch.
        factor: f64,
        /// The context the checkpoint was trained on.
        original_max_position: usize,
        /// Rotations that bound the extrapolated frequencies (32 by default).
        beta_fast: f64,
        /// Rotations that bound the interpolated frequencies (1 by default).
        beta_slow: f64,
        /// The scale of cos and sin.
        attention_factor: f64,
        /// Whether the correction range is rounded out to whole pairs (`truncate`: true by default;
        /// gpt-oss sets false).
        truncate: bool,
    },
}

impl RopeScaling {
    /// The scaling a Hugging Face `rope_scaling` entry describes, read as transformers reads it:
    /// `rope_type` (or the older `type`) and its fields, read through `field` (`factor`,
    /// `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`, `beta_fast`,
    /// `beta_slow`, `attention_factor`, `mscale`, `mscale_all_dim`, and `truncate`, a boolean read
    /// as 1 or 0). `max_position_embeddings` is the configuration's, the original context where the
    /// entry gives none (and, for YaRN without a `factor`, the stretched one: `factor` is then their
    /// ratio). As in transformers, a YaRN `beta_fast`, `beta_slow`, `mscale` or `mscale_all_dim` of 0
    /// counts as absent. `None` for `default` (no scaling). Every value is checked
    /// ([`RopeScaling::validate`]): an error names the field.
    ///
    /// ```
    /// use layers::RopeScaling;
    /// // Llama 3.1's entry.
    /// let entry = [("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192.0)];
    /// let field = |name: &str| entry.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    /// let scaling = RopeScaling::from_hugging_face("llama3", field, 131072)?.unwrap();
    /// assert!(matches!(scaling, RopeScaling::Llama3 { original_max_position: 8192, .. }));
    /// # Ok::<(), layers::RopeScalingError>(())
    /// ```
    pub fn from_hugging_face(
        rope_type: &str,
        field: impl Fn(&str) -> Option<f64>,
        max_position_embeddings: usize,
    ) -> Result<Option<RopeScaling>, RopeScalingError> {
        let kind: &'static str = match rope_type {
            "default" => return Ok(None),
            "linear" => "linear",
            "dynamic" => "dynamic",
            "llama3" => "llama3",
            "yarn" => "yarn",
            other => return Err(RopeScalingError::UnknownType(other.to_owned())),
        };
        let need = |name: &'static str| field(name).ok_or(RopeScalingError::Missing { kind, field: name });
        let original = field("original_max_position_embeddings").map_or(Ok(max_position_embeddings), |v| {
            if v.is_finite() && v >= 1.0 && v.fract() == 0.0 && v <= usize::MAX as f64 {
                Ok(v as usize)
            } else {
                Err(invalid("original_max_position_embeddings", v, "must be a positive whole number"))
            }
        })?;
        // A YaRN field of 0 is absent, as transformers' `or` reads it.
        let set = |name: &'static str| field(name).filter(|&v| v != 0.0);
        let scaling = match kind {
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "dynamic" => RopeScaling::DynamicNtk { factor: need("factor")?, original_max_position: original },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position: original,
            },
            _ => {
                let factor = field("factor").unwrap_or(max_position_embeddings as f64 / original as f64);
                for name in ["mscale", "mscale_all_dim"] {
                    if let Some(v) = field(name).filter(|v| !(v.is_finite() && *v >= 0.0)) {
                        return Err(invalid(name, v, "must be finite and not negative"));
                    }
                }
                let attention_factor = field("attention_factor").unwrap_or_else(|| {
                    RopeScaling::yarn_attention_factor(factor, set("mscale"), set("mscale_all_dim"))
                });
                let truncate = match field("truncate") {
                    None => true,
                    Some(v) if v == 0.0 || v == 1.0 => v == 1.0,
                    Some(v) => return Err(invalid("truncate", v, "must be a boolean (true or false)")),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position: original,
                    beta_fast: set("beta_fast").unwrap_or(32.0),
                    beta_slow: set("beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate,
                }
            }
        };
        scaling.validate()?;
        Ok(Some(scaling))
    }

    /// YaRN's default attention factor, as transformers computes it: with `m(s) = 0.1 · s ·
    /// ln(factor) + 1` (1 when `factor <= 1`), `m(mscale) / m(mscale_all_dim)` when both are given
    /// (DeepSeek's), else `m(1)` (a lone `mscale` is not used).
    pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, mscale_all_dim: Option<f64>) -> f64 {
        let m = |scale: f64| if factor <= 1.0 { 1.0 } else { 0.1 * scale * factor.ln() + 1.0 };
        match (mscale, mscale_all_dim) {
            (Some(mscale), Some(all)) => m(mscale) / m(all),
            _ => m(1.0),
        }
    }

    /// Checks every value: a `factor` finite and at least 1, an original context of at least one
    /// position, Llama 3's frequency factors positive and in order, YaRN's `beta_fast` and
    /// `beta_slow` finite, positive and in order and its attention factor finite and positive. An
    /// error names the field. [`inverse_frequencies`] and [`rope_cache`] call it, so a scaling built
    /// in code is checked too.
    pub fn validate(&self) -> Result<(), RopeScalingError> {
        let factor = match *self {
            RopeScaling::Linear { factor }
            | RopeScaling::DynamicNtk { factor, .. }
            | RopeScaling::Llama3 { factor, .. }
            | RopeScaling::Yarn { factor, .. } => factor,
        };
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(invalid("factor", factor, "must be finite and at least 1"));
        }
        match *self {
            RopeScaling::Linear { .. } => Ok(()),
            RopeScaling::DynamicNtk { original_max_position, .. } => positive_context(original_max_position),
            RopeScaling::Llama3 { low_freq_factor, high_freq_factor, original_max_position, .. } => {
                if !(low_freq_factor.is_finite() && low_freq_factor > 0.0) {
                    return Err(invalid("low_freq_factor", low_freq_factor, "must be finite and positive"));
                }
                if !(high_freq_factor.is_finite() && high_freq_factor > low_freq_factor) {
                    return Err(invalid(
                        "high_freq_factor",
                        high_freq_factor,
                        "must be finite and exceed low_freq_factor",
                    ));
                }
                positive_context(original_max_position)
            }
            RopeScaling::Yarn { beta_fast, beta_slow, attention_factor, original_max_position, .. } => {
                if !(beta_slow.is_finite() && beta_slow > 0.0) {
                    return Err(invalid("beta_slow", beta_slow, "must be finite and positive"));
                }
                if !(beta_fast.is_finite() && beta_fast >= beta_slow) {
                    return Err(invalid("beta_fast", beta_fast, "must be finite and at least beta_slow"));
                }
                if !(attention_factor.is_finite() && attention_factor > 0.0) {
                    return Err(invalid("attention_factor", attention_factor, "must be finite and positive"));
                }
                positive_context(original_max_position)
            }
        }
    }

    /// Positions the scaled cache covers, given the unscaled model's: the stretched context for
    /// dynamic NTK and YaRN, `max_position` otherwise.
    pub fn max_position(&self, max_position: usize) -> usize {
        match *self {
            RopeScaling::DynamicNtk { factor, original_max_position }
            | RopeScaling::Yarn { factor, original_max_position, .. } => {
                ((original_max_position as f64 * factor) as usize).max(max_position)
            }
            RopeScaling::Linear { .. } | RopeScaling::Llama3 { .. } => max_position,
        }
    }
}

/// A value out of its range.
fn invalid(field: &'static str, value: f64, reason: &'static str) -> RopeScalingError {
    RopeScalingError::Invalid { field, value, reason }
}

/// An original context of at least one position.
fn positive_context(original_max_position: usize) -> Result<(), RopeScalingError> {
    if original_max_position == 0 {
        return Err(invalid("original_max_position_embeddings", 0.0, "must be at least 1"));
    }
    Ok(())
}

/// The inverse frequencies `θ_i` of `rotary_dim / 2` pairs, with `scaling` applied (checked first:
/// [`RopeScaling::validate`]), and the scale of cos and sin.
pub fn inverse_frequencies(
    rotary_dim: usize,
    base: f64,
    scaling: Option<&RopeScaling>,
) -> Result<(Vec<f64>, f64), RopeScalingError> {
    let half = rotary_dim / 2;
    let d = rotary_dim as f64;
    let plain = |base: f64| -> Vec<f64> { (0..half).map(|i| base.powf(-2.0 * i as f64 / d)).collect() };
    if let Some(scaling) = scaling {
        scaling.validate()?;
    }
    Ok(match scaling.copied() {
        None => (plain(base), 1.0),
        Some(RopeScaling::Linear { factor }) => (plain(base).into_iter().map(|f| f / factor).collect(), 1.0),
        Some(RopeScaling::DynamicNtk { factor, .. }) => {
            // At the stretched length L = original · factor: base · (factor · L / original − (factor − 1))^(d/(d−2)).
            let stretched = base * (factor * factor - factor + 1.0).powf(d / (d - 2.0));
            (plain(stretched), 1.0)
        }
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => {
            let original = original_max_position as f64;
            let (low_wavelength, high_wavelength) = (original / low_freq_factor, original / high_freq_factor);
            let scaled = plain(base)
                .into_iter()
                .map(|f| {
                    let wavelength = 2.0 * std::f64::consts::PI / f;
                    if wavelength < high_wavelength {
                        f
                    } else if wavelength > low_wavelength {
                        f / factor
                    } else {
                        let smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect();
            (scaled, 1.0)
        }
        Some(RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor, truncate }) => {
            // The pair index whose frequency makes `rotations` turns over the original context.
            let correction = |rotations: f64| {
                d * (original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
            };
            let (low, high) = match truncate {
                true => (correction(beta_fast).floor(), correction(beta_slow).ceil()),
                false => (correction(beta_fast), correction(beta_slow)),
            };
            let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
            if high == low {
                high += 0.001;
            }
            let scaled = plain(base)
                .into_iter()
                .enumerate()
                .map(|(i, f)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    // 1 below the range (extrapolate: keep), 0 above it (interpolate: divide).
                    let keep = 1.0 - ramp;
                    f / factor * (1.0 - keep) + f * keep
                })
                .collect();
            (scaled, attention_factor)
        }
    })
}

/// The cos/sin cache for positions `0..max_position` (of the scaled model: see
/// [`RopeScaling::max_position`]), `[max_position, rotary_dim]`, cos then sin per position, each
/// scaled by the scaling's attention factor, computed in f64 and rounded once to `dtype`; a
/// scaling with a value out of its range is refused ([`RopeScaling::validate`]).
pub fn rope_cache(
    dtype: DType,
    max_position: usize,
    rotary_dim: usize,
    base: f64,
    scaling: Option<&RopeScaling>,
) -> Result<Tensor, LayerError> {
    let (frequencies, scale) = inverse_frequencies(rotary_dim, base, scaling)?;
    // The f64 values are built first: their count and bytes are checked, and the allocation may fail
    // with an error rather than abort (a scaled context can be large).
    let too_large = || TensorError::TooLarge { dtype, shape: vec![max_position, rotary_dim] };
    let count = max_position.checked_mul(rotary_dim).ok_or_else(too_large)?;
    let bytes = count.checked_mul(size_of::<f64>()).filter(|&b| b <= isize::MAX as usize).ok_or_else(too_large)?;
    let mut values = Vec::new();
    values.try_reserve_exact(count).map_err(|_| TensorError::from(ir_core::storage::OutOfMemory { bytes }))?;
    for position in 0..max_position {
        let angles: Vec<f64> = frequencies.iter().map(|f| position as f64 * f).collect();
        values.extend(angles.iter().map(|a| a.cos() * scale));
        values.extend(angles.iter().map(|a| a.sin() * scale));
    }
    Ok(Tensor::from_f64(dtype, &[max_position, rotary_dim], &values)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cache: &Tensor, position: usize) -> Vec<f64> {
        let values = cache.to_f64_vec().unwrap();
        let d = cache.shape()[1];
        values[position * d..(position + 1) * d].to_vec()
    }

    #[test]
    fn without_scaling_the_cache_is_the_ops_own() {
        let ours = rope_cache(DType::F32, 32, 16, 10000.0, None).unwrap();
        let op = ir_ops::rotary_embedding::cos_sin_cache(DType::F32, 32, 16, 10000.0).unwrap();
        assert!(ir_core::bit_eq(&ours, &op));
    }

    #[test]
    fn linear_scaling_divides_the_positions() {
        let scaled = rope_cache(DType::F64, 64, 16, 10000.0, Some(&RopeScaling::Linear { factor: 4.0 })).unwrap();
        let plain = rope_cache(DType::F64, 64, 16, 10000.0, None).unwrap();
        for p in 0..16 {
            let (a, b) = (row(&scaled, 4 * p), row(&plain, p));
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-12), "position {p}");
        }
    }

    #[test]
    fn llama3_keeps_high_frequencies_and_stretches_low_ones() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        let (scaled, scale) = inverse_frequencies(128, 500000.0, Some(&scaling)).unwrap();
        let (plain, _) = inverse_frequencies(128, 500000.0, None).unwrap();
        assert_eq!(scale, 1.0);
        let mut kept = 0;
        let mut stretched = 0;
        for (s, p) in scaled.iter().zip(&plain) {
            let wavelength = 2.0 * std::f64::consts::PI / p;
            if wavelength < 8192.0 / 4.0 {
                assert_eq!(s, p);
                kept += 1;
            } else if wavelength > 8192.0 {
                assert!((s - p / 8.0).abs() <= 1e-18 + p * 1e-15);
                stretched += 1;
            } else {
                assert!(*s < *p && *s > p / 8.0, "blended between");
            }
        }
        assert!(kept > 0 && stretched > 0, "both regimes occur at this base: {kept} kept, {stretched} stretched");
    }

    #[test]
    fn yarn_extrapolates_fast_pairs_interpolates_slow_ones_and_scales_the_cache() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: RopeScaling::yarn_attention_factor(4.0, None, None),
            truncate: true,
        };
        let (scaled, scale) = inverse_frequencies(64, 10000.0, Some(&scaling)).unwrap();
        let (plain, _) = inverse_frequencies(64, 10000.0, None).unwrap();
        assert_eq!(scaled[0], plain[0], "the fastest pair is kept");
        assert!((scaled[31] - plain[31] / 4.0).abs() < 1e-15, "the slowest pair is interpolated");
        assert!((scale - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        let cache = rope_cache(DType::F64, 16, 64, 10000.0, Some(&scaling)).unwrap();
        let r = row(&cache, 9);
        for i in 0..32 {
            let norm = (r[i] * r[i] + r[32 + i] * r[32 + i]).sqrt();
            assert!((norm - scale).abs() < 1e-12, "cos and sin scaled by the attention factor");
        }
        assert_eq!(scaling.max_position(4096), 16384);
    }

    #[test]
    fn dynamic_ntk_raises_the_base_for_the_stretched_context() {
        let scaling = RopeScaling::DynamicNtk { factor: 4.0, original_max_position: 2048 };
        let (scaled, _) = inverse_frequencies(128, 10000.0, Some(&scaling)).unwrap();
        // factor · L / original − (factor − 1) at L = 4 · 2048: 16 − 3.
        let base = 10000.0 * 13f64.powf(128.0 / 126.0);
        assert!((scaled[1] - base.powf(-2.0 / 128.0)).abs() < 1e-15);
        assert_eq!(scaled[0], 1.0, "the first pair turns once per position whatever the base");
        assert_eq!(scaling.max_position(2048), 8192);
    }

    #[test]
    fn a_cache_too_large_for_memory_is_an_error() {
        let err = rope_cache(DType::F32, usize::MAX / 2, 128, 10000.0, None).unwrap_err();
        assert!(matches!(err, LayerError::Tensor(TensorError::TooLarge { .. })), "{err}");
        let huge = RopeScaling::Linear { factor: 1.0 };
        let err = rope_cache(DType::F32, 1 << 50, 64, 10000.0, Some(&huge)).unwrap_err();
        let too_large = |e: &LayerError| {
            matches!(e, LayerError::Tensor(TensorError::OutOfMemory { .. } | TensorError::TooLarge { .. }))
        };
        assert!(too_large(&err), "{err}");
    }

    #[test]
    fn hugging_face_entries_read_or_name_their_problem() {
        let entry = |pairs: &'static [(&'static str, f64)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
        };
        assert_eq!(RopeScaling::from_hugging_face("default", entry(&[]), 4096), Ok(None));
        assert_eq!(
            RopeScaling::from_hugging_face("linear", entry(&[("factor", 2.0)]), 4096),
            Ok(Some(RopeScaling::Linear { factor: 2.0 }))
        );
        let yarn = RopeScaling::from_hugging_face("yarn", entry(&[("factor", 4.0)]), 32768).unwrap().unwrap();
        assert!(matches!(yarn, RopeScaling::Yarn { original_max_position: 32768, beta_fast, attention_factor, .. }
                if beta_fast == 32.0 && (attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15));
        let err = RopeScaling::from_hugging_face("su", entry(&[("factor", 2.0)]), 4096).unwrap_err();
        assert_eq!(err.to_string(), "rope_scaling type `su` is not one of linear, dynamic, llama3, yarn (or default)");
        let err = RopeScaling::from_hugging_face("llama3", entry(&[("factor", 8.0)]), 4096).unwrap_err();
        assert_eq!(err, RopeScalingError::Missing { kind: "llama3", field: "low_freq_factor" });
        let err = RopeScaling::from_hugging_face("linear", entry(&[("factor", 0.5)]), 4096).unwrap_err();
        assert!(err.to_string().contains("factor"), "{err}");
    }

    /// Every value that would build an all-NaN or all-zero cache (or frequencies from a reversed
    /// range) is refused with the field named, from code and from a `rope_scaling` entry alike.
    #[test]
    fn values_out_of_range_are_refused_naming_the_field() {
        let yarn = |factor: f64, beta_fast: f64, beta_slow: f64, attention_factor: f64| RopeScaling::Yarn {
            factor,
            original_max_position: 4096,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate: true,
        };
        let llama3 = |low_freq_factor: f64, high_freq_factor: f64| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor,
            high_freq_factor,
            original_max_position: 8192,
        };
        let cases = [
            (RopeScaling::Linear { factor: 0.0 }, "factor"),
            (RopeScaling::Linear { factor: -2.0 }, "factor"),
            (RopeScaling::Linear { factor: f64::NAN }, "factor"),
            (RopeScaling::DynamicNtk { factor: f64::INFINITY, original_max_position: 2048 }, "factor"),
            (RopeScaling::DynamicNtk { factor: 2.0, original_max_position: 0 }, "original_max_position_embeddings"),
            (llama3(0.0, 4.0), "low_freq_factor"),
            (llama3(4.0, 1.0), "high_freq_factor"),
            (llama3(1.0, f64::NAN), "high_freq_factor"),
            (yarn(4.0, 0.0, 1.0, 1.1), "beta_fast"),
            (yarn(4.0, 1.0, 32.0, 1.1), "beta_fast"),
            (yarn(4.0, 32.0, 0.0, 1.1), "beta_slow"),
            (yarn(4.0, 32.0, 1.0, 0.0), "attention_factor"),
            (yarn(4.0, 32.0, 1.0, f64::NAN), "attention_factor"),
            (yarn(f64::NAN, 32.0, 1.0, 1.1), "factor"),
        ];
        for (scaling, field) in cases {
            let err = scaling.validate().unwrap_err();
            assert!(
                matches!(err, RopeScalingError::Invalid { field: named, .. } if named == field),
                "{scaling:?}: {err}"
            );
            assert!(inverse_frequencies(64, 10000.0, Some(&scaling)).is_err(), "{scaling:?}");
            let err = rope_cache(DType::F32, 8, 64, 10000.0, Some(&scaling)).unwrap_err();
            assert!(matches!(err, LayerError::RopeScaling(_)), "{err}");
        }
        let entry = |pairs: &'static [(&'static str, f64)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
        };
        let refused = [
            ("yarn", &[("factor", f64::NAN)][..], "factor"),
            ("yarn", &[("factor", 4.0), ("attention_factor", 0.0)][..], "attention_factor"),
            ("yarn", &[("factor", 4.0), ("mscale", f64::NAN)][..], "mscale"),
            ("yarn", &[("factor", 4.0), ("mscale_all_dim", -1.0)][..], "mscale_all_dim"),
            ("yarn", &[("factor", 4.0), ("beta_fast", 1.0), ("beta_slow", 2.0)][..], "beta_fast"),
            ("yarn", &[("factor", 4.0), ("truncate", 0.5)][..], "truncate"),
            ("linear", &[("factor", f64::INFINITY)][..], "factor"),
            ("dynamic", &[("factor", 0.0)][..], "factor"),
            ("llama3", &[("factor", 8.0), ("low_freq_factor", 4.0), ("high_freq_factor", 1.0)][..], "high_freq_factor"),
        ];
        for (kind, pairs, field) in refused {
            let err = RopeScaling::from_hugging_face(kind, entry(pairs), 4096).unwrap_err();
            assert!(
                matches!(err, RopeScalingError::Invalid { field: named, .. } if named == field),
                "{pairs:?}: {err}"
            );
        }
        // As transformers reads them: a YaRN beta or mscale of 0 is absent, and a YaRN without a
        // factor stretches to the configuration's context.
        let zero_betas = entry(&[("factor", 4.0), ("beta_fast", 0.0), ("beta_slow", 0.0), ("mscale", 0.0)]);
        let yarn = RopeScaling::from_hugging_face("yarn", zero_betas, 4096).unwrap().unwrap();
        assert!(matches!(yarn, RopeScaling::Yarn { beta_fast: 32.0, beta_slow: 1.0, .. }), "{yarn:?}");
        let no_factor = entry(&[("original_max_position_embeddings", 4096.0)]);
        let yarn = RopeScaling::from_hugging_face("yarn", no_factor, 16384).unwrap().unwrap();
        assert!(matches!(yarn, RopeScaling::Yarn { factor: 4.0, .. }), "{yarn:?}");
    }
}
