//! Rotary frequencies and their scaling: the cos/sin caches a checkpoint's `rope_theta` and
//! `rope_scaling` ask for (linear, dynamic NTK, Llama 3, YaRN), in the layout `rotary_embedding`
//! takes (`[max_position, rotary_dim]`, cos then sin per position), computed in f64 and rounded
//! once to the cache's dtype.

use ir_core::{DType, Tensor, TensorError};

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
    /// `attention_factor` (by default `0.1 · ln(factor) + 1`) (`"yarn"`).
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
    },
}

/// A `rope_scaling` that cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RopeScalingError {
    /// An unknown `rope_type`.
    #[error("rope_scaling type `{0}` is not one of linear, dynamic, llama3, yarn (or default)")]
    UnknownType(String),
    /// A field the type needs.
    #[error("rope_scaling `{kind}` needs `{field}`")]
    Missing {
        /// The type.
        kind: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A value out of its range.
    #[error("rope_scaling `{field}` = {value}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// Why.
        reason: &'static str,
    },
}

impl RopeScaling {
    /// The scaling a Hugging Face `rope_scaling` entry describes: `rope_type` (or the older
    /// `type`) and its numeric fields, read through `field` (`factor`, `low_freq_factor`,
    /// `high_freq_factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`,
    /// `attention_factor`, `mscale`). `default_original_max_position` is the configuration's
    /// `max_position_embeddings`, used where the entry has no original length. `None` for
    /// `default` (no scaling).
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
        default_original_max_position: usize,
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
        let factor = need("factor")?;
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(RopeScalingError::Invalid {
                field: "factor",
                value: factor,
                reason: "must be finite and >= 1",
            });
        }
        let original = field("original_max_position_embeddings").map_or(Ok(default_original_max_position), |v| {
            if v.is_finite() && v >= 1.0 && v.fract() == 0.0 {
                Ok(v as usize)
            } else {
                Err(RopeScalingError::Invalid {
                    field: "original_max_position_embeddings",
                    value: v,
                    reason: "must be a positive whole number",
                })
            }
        })?;
        Ok(Some(match kind {
            "linear" => RopeScaling::Linear { factor },
            "dynamic" => RopeScaling::DynamicNtk { factor, original_max_position: original },
            "llama3" => {
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if !(low > 0.0 && high > low) {
                    return Err(RopeScalingError::Invalid {
                        field: "high_freq_factor",
                        value: high,
                        reason: "must exceed low_freq_factor, which must be positive",
                    });
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position: original,
                }
            }
            _ => RopeScaling::Yarn {
                factor,
                original_max_position: original,
                beta_fast: field("beta_fast").unwrap_or(32.0),
                beta_slow: field("beta_slow").unwrap_or(1.0),
                attention_factor: field("attention_factor")
                    .unwrap_or_else(|| field("mscale").unwrap_or(1.0) * yarn_mscale(factor)),
            },
        }))
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

/// YaRN's default attention scale: `0.1 · ln(factor) + 1` (1 at factor 1).
fn yarn_mscale(factor: f64) -> f64 {
    if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 }
}

/// The inverse frequencies `θ_i` of `rotary_dim / 2` pairs, with `scaling` applied, and the scale
/// of cos and sin.
pub fn inverse_frequencies(rotary_dim: usize, base: f64, scaling: Option<&RopeScaling>) -> (Vec<f64>, f64) {
    let half = rotary_dim / 2;
    let d = rotary_dim as f64;
    let plain = |base: f64| -> Vec<f64> { (0..half).map(|i| base.powf(-2.0 * i as f64 / d)).collect() };
    match scaling.copied() {
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
        Some(RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor }) => {
            // The pair index whose frequency makes `rotations` turns over the original context.
            let correction = |rotations: f64| {
                d * (original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
            };
            let low = correction(beta_fast).floor().max(0.0);
            let mut high = correction(beta_slow).ceil().min(d - 1.0);
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
    }
}

/// The cos/sin cache for positions `0..max_position` (of the scaled model: see
/// [`RopeScaling::max_position`]), `[max_position, rotary_dim]`, cos then sin per position, each
/// scaled by the scaling's attention factor, computed in f64 and rounded once to `dtype`.
pub fn rope_cache(
    dtype: DType,
    max_position: usize,
    rotary_dim: usize,
    base: f64,
    scaling: Option<&RopeScaling>,
) -> Result<Tensor, TensorError> {
    let (frequencies, scale) = inverse_frequencies(rotary_dim, base, scaling);
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
    Tensor::from_f64(dtype, &[max_position, rotary_dim], &values)
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
        let (scaled, scale) = inverse_frequencies(128, 500000.0, Some(&scaling));
        let (plain, _) = inverse_frequencies(128, 500000.0, None);
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
            attention_factor: yarn_mscale(4.0),
        };
        let (scaled, scale) = inverse_frequencies(64, 10000.0, Some(&scaling));
        let (plain, _) = inverse_frequencies(64, 10000.0, None);
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
        let (scaled, _) = inverse_frequencies(128, 10000.0, Some(&scaling));
        // factor · L / original − (factor − 1) at L = 4 · 2048: 16 − 3.
        let base = 10000.0 * 13f64.powf(128.0 / 126.0);
        assert!((scaled[1] - base.powf(-2.0 / 128.0)).abs() < 1e-15);
        assert_eq!(scaled[0], 1.0, "the first pair turns once per position whatever the base");
        assert_eq!(scaling.max_position(2048), 8192);
    }

    #[test]
    fn a_cache_too_large_for_memory_is_an_error() {
        let err = rope_cache(DType::F32, usize::MAX / 2, 128, 10000.0, None).unwrap_err();
        assert!(matches!(err, TensorError::TooLarge { .. }), "{err}");
        let huge = RopeScaling::Linear { factor: 1.0 };
        let err = rope_cache(DType::F32, 1 << 50, 64, 10000.0, Some(&huge)).unwrap_err();
        assert!(matches!(err, TensorError::OutOfMemory { .. } | TensorError::TooLarge { .. }), "{err}");
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
                if beta_fast == 32.0 && (attention_factor - yarn_mscale(4.0)).abs() < 1e-15));
        let err = RopeScaling::from_hugging_face("su", entry(&[("factor", 2.0)]), 4096).unwrap_err();
        assert_eq!(err.to_string(), "rope_scaling type `su` is not one of linear, dynamic, llama3, yarn (or default)");
        let err = RopeScaling::from_hugging_face("llama3", entry(&[("factor", 8.0)]), 4096).unwrap_err();
        assert_eq!(err, RopeScalingError::Missing { kind: "llama3", field: "low_freq_factor" });
        let err = RopeScaling::from_hugging_face("linear", entry(&[("factor", 0.5)]), 4096).unwrap_err();
        assert!(err.to_string().contains("factor"), "{err}");
    }
}
