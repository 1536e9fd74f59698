//! Helpers for tests of this and other crates: skips that say why, and the seeded input source of
//! the ops' generators (feature `testing`).

use std::io::Write;

/// Says that a test cannot run here and why, on stderr (which libtest does not capture), unless the
/// backend is listed in `VLLM_IR_REQUIRE` (comma list of `xpu`, `nvrtc`, `hip`, `ptxas`, `cxx`, …), in which case the
/// skip is a failure.
///
/// Returns normally so the caller can `return` right after it.
pub fn skip(backend: &str, reason: &str) {
    let required = std::env::var("VLLM_IR_REQUIRE").unwrap_or_default();
    let is_required = required.split(',').map(str::trim).any(|b| b == backend);
    assert!(!is_required, "`{backend}` is required (VLLM_IR_REQUIRE={required}) but unavailable: {reason}");
    let _ = writeln!(std::io::stderr(), "skipped: {reason}");
}

/// A seeded source of test inputs for the ops' input generators: normal tensors, deterministic for a
/// seed (equal seeds give equal bits). Feature `testing`; without it every draw is
/// [`TensorError::TestingDisabled`](crate::TensorError::TestingDisabled), so an engine built without
/// the random-number crates still links every op definition.
#[derive(Debug)]
pub struct InputRng {
    #[cfg(feature = "testing")]
    rng: rand_chacha::ChaCha8Rng,
}

impl InputRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> InputRng {
        #[cfg(feature = "testing")]
        return InputRng { rng: rand::SeedableRng::seed_from_u64(seed) };
        #[cfg(not(feature = "testing"))]
        {
            let _ = seed;
            InputRng {}
        }
    }

    /// A compact CPU tensor of N(mean, std) values rounded to `dtype` (`std` > 0).
    pub fn normal(
        &mut self,
        dtype: crate::DType,
        shape: &[usize],
        mean: f64,
        std: f64,
    ) -> Result<crate::Tensor, crate::TensorError> {
        #[cfg(feature = "testing")]
        {
            use rand::Rng;
            let normal = rand_distr::Normal::new(mean, std).expect("finite mean and positive std");
            let n = crate::layout::numel(shape);
            let values: Vec<f64> = (0..n).map(|_| self.rng.sample(normal)).collect();
            crate::Tensor::from_f64(dtype, shape, &values)
        }
        #[cfg(not(feature = "testing"))]
        {
            let _ = (dtype, shape, mean, std);
            Err(crate::TensorError::TestingDisabled)
        }
    }
}
