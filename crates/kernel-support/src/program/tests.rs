//! The generators' output, read (running it is the emulated GPU's, PoCL's and NVRTC's tests).

use ir_core::{DType, Tensor};
use ir_ops::Rounding;
use ir_ops::row_program::{RowArg, builtin};

use super::{gpu_source, opencl_source};

#[test]
fn both_dialects_fuse_each_pass_into_one_loop_in_their_own_terms() {
    let program = builtin::norm_dynamic_per_token_quant(true, true, false, DType::F8E4M3FN, Rounding::Exact).unwrap();
    let x = Tensor::zeros(DType::BF16, &[2, 64]).unwrap();
    let w = Tensor::zeros(DType::BF16, &[64]).unwrap();
    let binding =
        program.bind(&[RowArg::Tensor(&x), RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-6)]).unwrap();
    let cuda = gpu_source(&program, &binding, super::RowShape::for_call(&program, &binding, true)).unwrap();
    let opencl = opencl_source(&program, &binding).unwrap();
    // Three passes (the sum of squares, the absmax, the codes), each one walk over a thread's
    // chunks (the cached ones, then those past them), and two row reductions; x and the residual
    // are loaded 16 bytes at a time into registers once, in the first pass.
    assert_eq!(cuda.matches("for (long long c = lane + (long long)").count(), 3, "{cuda}");
    assert_eq!(cuda.matches("rp_row_reduce<").count(), 2, "{cuda}");
    assert_eq!(cuda.matches("[k].load(").count(), 2, "{cuda}");
    // The weight's chunks loaded ahead of their use in the two passes that read it.
    assert_eq!(cuda.matches("wt2[k - k0].load(").count(), 2, "{cuda}");
    assert!(cuda.contains("RpChunk<2, 8, true> ld0_0["), "{cuda}");
    assert!(cuda.contains("fp8_e4m3("), "{cuda}");
    assert_eq!(opencl.matches("for (int j = get_local_id(0); j < width;").count(), 3, "{opencl}");
    assert_eq!(opencl.matches("rp_block_sum_").count() + opencl.matches("rp_block_max_").count(), 2 + 4);
    assert!(opencl.contains("fp8_from_f32(rp_narrow_f("), "{opencl}");
    // The buffers take an offset each on OpenCL (x, residual, weight; the sum, codes, scales), none
    // on CUDA.
    assert_eq!(opencl.matches("_off,").count() + opencl.matches("_off)").count(), 6, "{opencl}");
    assert!(!cuda.contains("_off"), "{cuda}");
    for cuda_only in ["Elem<", "c_add", "threadIdx", "__shared__", "long long", "GPU_ROWS"] {
        assert!(!opencl.contains(cuda_only), "OpenCL source holds `{cuda_only}`:\n{opencl}");
    }
    for opencl_only in ["__kernel", "__local", "get_local_id", "vload_half", "rp_narrow"] {
        assert!(!cuda.contains(opencl_only), "CUDA source holds `{opencl_only}`:\n{cuda}");
    }
}

#[test]
fn an_f64_value_stored_as_fp8_is_rounded_to_odd_first_in_both_dialects() {
    // f64 activations compute in double: an fp8 store narrows through f32 rounded to odd, so the
    // code is the double's nearest, not the nearest of its f32 rounding.
    let program = builtin::dynamic_per_token_scaled_fp8_quant(DType::F8E4M3FN, false).unwrap();
    let x = Tensor::zeros(DType::F64, &[2, 64]).unwrap();
    let binding = program.bind(&[RowArg::Tensor(&x)]).unwrap();
    assert!(
        gpu_source(&program, &binding, super::RowShape::for_call(&program, &binding, true))
            .unwrap()
            .contains("fp8_e4m3(f32_round_to_odd(")
    );
    assert!(opencl_source(&program, &binding).unwrap().contains("fp8_from_f32(rp_narrow_d("));
}
