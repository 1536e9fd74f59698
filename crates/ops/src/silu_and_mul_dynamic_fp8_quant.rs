//! `silu_and_mul_dynamic_fp8_quant(x, scale_ub = none, out_dtype = f8e4m3fn) -> (q, scales)`:
//! `silu_and_mul` then `dynamic_per_token_scaled_fp8_quant` of its output, as one op (what vLLM
//! fuses on GPUs before an fp8 matmul): x's gated output is never stored.
//!
//! `x` is `[..., 2d]` in f32, f16, bf16 or f64 (gate, then up); `scale_ub`, when given, an f32
//! tensor of one element on x's device; `q` a fresh compact `[..., d]` tensor in `out_dtype`
//! (`f8e4m3fn` or `f8e5m2`) and `scales` a fresh compact f32 `[..., 1]`. The semantics are the
//! unfused pair's, bit for bit: the gated value `silu(g)·u` rounded to x's dtype as `silu_and_mul`
//! stores it, then the per-token scale and codes of
//! [`dynamic_per_token_scaled_fp8_quant`](crate::dynamic_per_token_scaled_fp8_quant).
//! [`row_program::builtin::silu_and_mul_dynamic_fp8_quant`](crate::row_program::builtin::silu_and_mul_dynamic_fp8_quant)
//! is that computation as a row program: `native` runs it on the reference interpreter, every GPU
//! provider as the kernel generated from it; the cpu provider composes its `silu_and_mul` and
//! quantization rows per row (rows of one stride; the program's bits, tested), or runs the
//! program on its block-vectorized interpreter. Not in place; activations `[x]`.

use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Tolerance, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

use crate::gated::{gated_inputs, gated_meta};
use crate::quant::{check_scale, fp8_dtype, quantized_meta, scales_meta};
use crate::row_program::{RowArg, RowProgram};

ir_core::define_op! {
    /// The definition of `silu_and_mul_dynamic_fp8_quant`.
    op silu_and_mul_dynamic_fp8_quant {
        def: SILU_AND_MUL_DYNAMIC_FP8_QUANT,
        args: SiluAndMulDynamicFp8QuantArgs,
        params: (
            /// Input `[..., 2d]`: gate, then up.
            x: Activation,
            /// Optional upper bound of each row's absmax: an f32 tensor of one element.
            scale_ub: Option<Tensor> = Literal::None,
            /// The fp8 format of the output.
            out_dtype: DType = Literal::DType(DType::F8E4M3FN),
        ),
        outputs: (Tensor, Tensor),
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        // The scales come from the gated values rounded to x's dtype, where a kernel's silu may
        // land one step from native's: one bf16 step, relative.
        tolerances: &[(DType::F32, Tolerance { atol: 1e-7, rtol: 7.8125e-3 })],
        description: "silu_and_mul then fp8 quantization with one scale per row, fused; returns (q, scales)",
    }
}

/// The op's row program for `out_dtype` (an fp8 dtype) with or without a bound, built once per
/// process.
pub fn program(out_dtype: DType, scale_ub: bool) -> Result<&'static RowProgram, KernelError> {
    static PROGRAMS: std::sync::OnceLock<Vec<RowProgram>> = std::sync::OnceLock::new();
    let programs = PROGRAMS.get_or_init(|| {
        [(DType::F8E4M3FN, false), (DType::F8E4M3FN, true), (DType::F8E5M2, false), (DType::F8E5M2, true)]
            .into_iter()
            .map(|(dtype, ub)| {
                crate::row_program::builtin::silu_and_mul_dynamic_fp8_quant(dtype, ub).expect("an fp8 dtype")
            })
            .collect()
    });
    let format = match out_dtype {
        DType::F8E4M3FN => 0,
        DType::F8E5M2 => 2,
        other => return Err(KernelError::NotFp8 { dtype: other }),
    };
    Ok(&programs[format + usize::from(scale_ub)])
}

/// The arguments of the op's program for a call: `x`, then the bound when given.
pub fn program_args<'a>(x: &'a Tensor, scale_ub: Option<&'a Tensor>) -> Vec<RowArg<'a>> {
    std::iter::once(RowArg::Tensor(x)).chain(scale_ub.map(RowArg::Tensor)).collect()
}

/// The reference implementation: its row program on the reference interpreter.
pub fn native(x: &Tensor, scale_ub: Option<&Tensor>, out_dtype: DType) -> Result<(Tensor, Tensor), KernelError> {
    let ub_meta = scale_ub.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()));
    meta(&SILU_AND_MUL_DYNAMIC_FP8_QUANT, &[ArgMeta::Tensor(x.meta()), ub_meta, ArgMeta::DType(out_dtype)])?;
    let (q, scales) = run_with(|program, args| Ok(program.run(args)?), x, scale_ub, out_dtype)?;
    Ok(if x.device().is_cpu() { (q, scales) } else { (q.to_device_of(x)?, scales.to_device_of(x)?) })
}

/// The op on an executor of row programs (`run`: the reference interpreter, the cpu's, a GPU
/// backend's): its program for the call, run on the call's arguments, and the outputs (codes,
/// scales). What every implementation of the op is.
pub fn run_with(
    run: impl FnOnce(&RowProgram, &[RowArg<'_>]) -> Result<Vec<Tensor>, KernelError>,
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let mut outputs = run(program(out_dtype, scale_ub.is_some())?, &program_args(x, scale_ub))?;
    let scales = outputs.pop().expect("two outputs");
    Ok((outputs.pop().expect("two outputs"), scales))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let x = args.first().and_then(ArgMeta::tensor);
    let gated = gated_meta(op, x)?;
    let x = x.expect("gated_meta checked x");
    match args.get(SiluAndMulDynamicFp8QuantArgs::scale_ub) {
        Some(ArgMeta::None) => {}
        Some(ArgMeta::Tensor(ub)) => check_scale(op, "scale_ub", ub, x)?,
        _ => return Err(MetaError::Kind { op, param: "scale_ub" }),
    }
    let dtype = fp8_dtype(op, args.get(SiluAndMulDynamicFp8QuantArgs::out_dtype))?;
    Ok(ir_core::op::smallvec![quantized_meta(&gated, dtype), scales_meta(&gated)])
}

/// `x ~ N(0, 1)` of `[T, 2H]` and the absmax bound 3.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let scale_ub = Tensor::from_f64(DType::F32, &[1], &[3.0])?;
    gated_inputs(spec, [Value::Tensor(scale_ub), Value::DType(DType::F8E4M3FN)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::bit_eq;

    /// The op is the unfused pair, bit for bit, in every compute dtype, with and without a bound,
    /// in both fp8 formats.
    #[test]
    fn the_fused_op_gives_the_unfused_pairs_bits() {
        let mut rng = ir_core::testing::InputRng::new(5);
        let bound = Tensor::from_f64(DType::F32, &[1], &[2.5]).unwrap();
        for dtype in DType::COMPUTE {
            let x = rng.normal(dtype, &[3, 2 * 40], 0.0, 2.0).unwrap();
            for out_dtype in [DType::F8E4M3FN, DType::F8E5M2] {
                for ub in [None, Some(&bound)] {
                    let (q, scales) = native(&x, ub, out_dtype).unwrap();
                    let gated = crate::silu_and_mul::native(&x).unwrap();
                    let (q2, scales2) =
                        crate::dynamic_per_token_scaled_fp8_quant::native(&gated, ub, out_dtype).unwrap();
                    assert!(bit_eq(&q, &q2), "{dtype} {out_dtype} bound {}: codes", ub.is_some());
                    assert!(bit_eq(&scales, &scales2), "{dtype} {out_dtype} bound {}: scales", ub.is_some());
                    assert_eq!((q.shape(), scales.shape()), ([3, 40].as_slice(), [3, 1].as_slice()));
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_parameter() {
        let odd = Tensor::zeros(DType::F32, &[2, 3]).unwrap();
        let error = native(&odd, None, DType::F8E4M3FN).unwrap_err().to_string();
        assert!(error.contains("even last dimension"), "{error}");
        let x = Tensor::zeros(DType::F32, &[2, 4]).unwrap();
        let error = native(&x, None, DType::BF16).unwrap_err().to_string();
        assert!(error.contains("out_dtype"), "{error}");
        let two = Tensor::zeros(DType::F32, &[2]).unwrap();
        let error = native(&x, Some(&two), DType::F8E4M3FN).unwrap_err().to_string();
        assert!(error.contains("scale_ub"), "{error}");
    }
}
