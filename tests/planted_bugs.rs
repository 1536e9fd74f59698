//! The kernel harness catches bugs planted in the CUDA kernel source: each test runs an op on the
//! emulated CUDA provider from the source as it is (its values checked against native), then from
//! a mutated copy of the source, whose run must fail or give other bits. The four classes: a wrong
//! shuffle tree, a removed barrier, a missing rounding and a removed subnormal clamp.
//!
//! The mutated source is planted process-wide (`kernels_cuda::emu::plant`), so these tests have a
//! binary of their own.

use ir_core::Call;
use ir_core::op::{Overload, Value, tolerance};
use ir_core::{DType, Registry, Tensor, TensorMeta, allclose, bit_eq};
use kernels_cuda::emu::{SourceEdit, plant};

/// A registry whose every op runs on the emulated CUDA provider alone (no native fallback), or
/// `None` (said on stderr) where the emulator cannot build programs.
fn emulated() -> Option<(Registry, Vec<ir_core::PriorityGuard>)> {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::emu::availability() {
        ir_core::testing::skip("cxx", &format!("planted bugs: the emulated cuda provider cannot run: {reason}"));
        return None;
    }
    let registry = ir_ops::registry();
    kernels_cuda::emu::register(&registry).unwrap();
    let guards = ir_ops::BUILTIN_OPS
        .iter()
        .map(|op| registry.override_priority(op.name, &[kernels_cuda::emu::PROVIDER]).unwrap())
        .collect();
    Some((registry, guards))
}

fn upload(t: &Tensor) -> Tensor {
    let host = t.deep_clone_same_layout().unwrap();
    let buffer = host.cpu_buffer().unwrap();
    let mut device =
        ir_core::storage::DeviceAllocator::allocate(&kernels_cuda::emu::allocator(), buffer.len_bytes()).unwrap();
    device.upload(buffer.bytes()).unwrap();
    Tensor::from_storage(ir_core::storage::Storage::Device(device), host.dtype(), host.layout().clone()).unwrap()
}

/// Runs `op` on the emulator with `args` (host tensors, uploaded), as the source is and with
/// `edit` planted: the first run must match native within the op's tolerance, the second must fail
/// or differ from the first in some bit.
fn assert_caught(registry: &Registry, op: &'static ir_core::op::OpDef, args: Vec<Value>, edit: SourceEdit) {
    let device_args = || -> Vec<Value> {
        args.iter().map(|v| if let Value::Tensor(t) = v { Value::Tensor(upload(t)) } else { v.clone() }).collect()
    };
    let run = || -> Result<Vec<Tensor>, String> {
        let outputs = registry.run(Call::new(op.name, Overload::Default, device_args())).map_err(|e| e.to_string())?;
        Ok(outputs.iter().map(|t| t.to_cpu().unwrap().contiguous().unwrap()).collect())
    };
    let good = run().unwrap_or_else(|e| panic!("{}: the source as it is fails: {e}", op.name));
    let expected = (op.native)(&args).unwrap();
    for (index, (got, want)) in good.iter().zip(&expected).enumerate() {
        let tol = tolerance(op, want.dtype()).unwrap();
        allclose(got, want, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{} output {index}: {e}", op.name));
    }
    let planted = plant(edit);
    let mutated = run();
    assert!(planted.programs_changed() > 0, "{}: `{}` is in no program the op ran", op.name, edit.find);
    drop(planted);
    match mutated {
        Err(message) => eprintln!("{}: the planted bug fails the launch: {message}", op.name),
        Ok(outputs) => {
            let same = outputs.iter().zip(&good).all(|(a, b)| bit_eq(a, b));
            assert!(!same, "{}: `{}` -> `{}` went unnoticed", op.name, edit.find, edit.replace);
        }
    }
}

fn randn(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(&TensorMeta::compact(dtype, shape), seed).unwrap()
}

#[test]
fn a_wrong_shuffle_tree_is_caught() {
    let Some((registry, _priorities)) = emulated() else { return };
    // 4096 elements: 64 threads a row, so the row sum crosses warps (the top level of the tree).
    let (x, w) = (randn(DType::F32, &[3, 4096], 1), randn(DType::F32, &[4096], 2));
    let args = vec![Value::Tensor(x), Value::Tensor(w), Value::F64(1e-6), Value::None];
    let edit = SourceEdit {
        find: "for (int offset = warp / 2; offset > 0; offset >>= 1)",
        replace: "for (int offset = warp / 4; offset > 0; offset >>= 1)",
    };
    assert_caught(&registry, &ir_ops::rms_norm::RMS_NORM, args, edit);
}

#[test]
fn a_removed_barrier_is_caught() {
    let Some((registry, _priorities)) = emulated() else { return };
    let x = randn(DType::F32, &[5, 3000], 3);
    let args = vec![Value::Tensor(x), Value::None, Value::DType(DType::F8E4M3FN)];
    let edit = SourceEdit {
        find: "    scratch[threadIdx.x] = value;\n    __syncthreads();",
        replace: "    scratch[threadIdx.x] = value;",
    };
    assert_caught(
        &registry,
        &ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT,
        args,
        edit,
    );
}

#[test]
fn a_missing_rounding_is_caught() {
    let Some((registry, _priorities)) = emulated() else { return };
    let (x, w) = (randn(DType::BF16, &[8, 1024], 4), randn(DType::BF16, &[1024], 5));
    let ub = Tensor::from_f64(DType::F32, &[1], &[100.0]).unwrap();
    let args = vec![
        Value::Tensor(x),
        Value::Tensor(w),
        Value::F64(1e-6),
        Value::Tensor(ub),
        Value::DType(DType::F8E4M3FN),
        Value::Str("exact".into()),
    ];
    let edit = SourceEdit { find: "a[i] = round_elem<DT>(c_mul(a[i], rstd));", replace: "a[i] = c_mul(a[i], rstd);" };
    assert_caught(&registry, &ir_ops::rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT, args, edit);
}

#[test]
fn a_removed_subnormal_clamp_is_caught() {
    let Some((registry, _priorities)) = emulated() else { return };
    // Magnitudes below e4m3's smallest normal (2^-6) once divided by the scale: subnormal codes.
    let values: Vec<f64> = (0..2048).map(|i| ((i % 97) as f64 - 48.0) * 3e-4).collect();
    let x = Tensor::from_f64(DType::F32, &[2, 1024], &values).unwrap();
    let scale = Tensor::from_f64(DType::F32, &[1], &[1.0]).unwrap();
    let args = vec![Value::Tensor(x), Value::Tensor(scale), Value::DType(DType::F8E4M3FN), Value::Str("exact".into())];
    let edit = SourceEdit {
        find: "int e = max((int)((__float_as_uint(a) >> 23) & 0xffu) - 127, emin);",
        replace: "int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;",
    };
    assert_caught(&registry, &ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT, args, edit);
}
