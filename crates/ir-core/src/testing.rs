//! Helpers for tests of this and other crates: skips that say why, and the seeded input source of
//! the ops' generators (feature `testing`).

use std::io::Write;

/// Says that a test cannot run here and why, on stderr (which libtest does not capture), unless the
/// backend is listed in `VLLM_IR_REQUIRE` (comma list of `xpu`, `nvrtc`, `hip`, `ptxas`), in which case the
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

/// Checks a device's `clone` and `contiguous` (its `DeviceBuffer::copy_strided`) bit for bit in every
/// dtype, on views that are transposed, sliced (an offset), both, and of rank 3, against the same
/// views on the host; panics naming the dtype and layout that differ. For the kernel crates' tests.
pub fn check_device_copies(allocator: &dyn crate::storage::DeviceAllocator) {
    use crate::{DType, Tensor, bit_eq};
    for dtype in DType::ALL {
        // Quarter steps, signed: every dtype, 8-bit ones included, holds neighbours apart.
        let values: Vec<f64> = (0..84).map(|i| ((i * 37) % 29) as f64 / 4.0 - 3.5).collect();
        let host = Tensor::from_f64(dtype, &[7, 12], &values).expect("a small tensor");
        let views = [
            host.clone(),
            host.transpose(0, 1).expect("rank 2"),
            host.slice(1, 2, 9).expect("in range"),
            host.slice(0, 1, 6).and_then(|t| t.transpose(0, 1)).expect("in range"),
            host.reshape(&[2, 3, 14]).and_then(|t| t.transpose(0, 2)).expect("84 elements"),
        ];
        for view in views {
            let label = format!("{dtype} {}", view.layout());
            let on_device = host
                .to_device(allocator)
                .and_then(|t| t.as_strided(view.layout().clone()))
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let contiguous = on_device.contiguous().unwrap_or_else(|e| panic!("{label}: {e}"));
            let cloned = on_device.deep_clone().unwrap_or_else(|e| panic!("{label}: {e}"));
            assert!(contiguous.layout().is_compact_at_zero(), "{label}: contiguous is compact");
            assert!(bit_eq(&contiguous.to_cpu().expect("download"), &view), "{label}: contiguous");
            assert!(bit_eq(&cloned.to_cpu().expect("download"), &view), "{label}: clone");
        }
    }
}
