//! `VLLM_IR_CPU_ROWS=portable` forces the portable row kernels (the choice is made once per
//! process, so this binary holds this one test and sets the variable before the first call). That
//! both paths give the same bits is tested row by row in the crate's unit tests; here the forced
//! path runs the public kernels end to end.

use ir_core::{DType, Tensor, TensorMeta, UniqueTensor};

#[test]
fn the_env_var_forces_the_portable_rows_with_the_same_bits() {
    // SAFETY: set before any thread of this process reads the environment (the only test here).
    unsafe { std::env::set_var(kernels_cpu::ROW_PATH_ENV, "portable") };
    assert_eq!(kernels_cpu::row_path(), kernels_cpu::RowPath::Portable { forced: true });
    assert_eq!(kernels_cpu::row_path().to_string(), "portable (forced by VLLM_IR_CPU_ROWS=portable)");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for hidden in [1, 31, 32, 33, 4096 + 17] {
            let x = Tensor::randn(&TensorMeta::compact(dtype, &[3, hidden]), 11).unwrap();
            let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 13).unwrap();
            let out = kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).unwrap();
            // The fused op's norm of x + 0 must be rms_norm(x) bit for bit, and both near native.
            let zeros = Tensor::zeros(dtype, &[3, hidden]).unwrap();
            let (fused, residual) = kernels_cpu::fused_add_rms_norm_cpu(
                UniqueTensor::new(x.deep_clone().unwrap()).unwrap(),
                UniqueTensor::new(zeros).unwrap(),
                Some(&w),
                1e-6,
                None,
                ir_ops::Rounding::Exact,
            )
            .unwrap();
            assert!(ir_core::bit_eq(&residual, &x), "{dtype} {hidden}: x + 0 = x");
            assert!(ir_core::bit_eq(&fused, &out), "{dtype} {hidden}: fused(x, 0) = rms_norm(x)");
            let native = ir_ops::rms_norm::native(&x, Some(&w), 1e-6, None).unwrap();
            ir_core::allclose(&out, &native, 2e-2, 2e-2).unwrap_or_else(|e| panic!("{dtype} {hidden}: {e}"));
        }
    }
}
