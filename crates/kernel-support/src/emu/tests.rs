//! The emulator on small kernels written for it (what each built-in does, and the errors a kernel
//! that would hang gets), then on the shared gated source as NVRTC gets it.

use super::*;

/// Whether the emulator can run here; says why not otherwise (a failure when `VLLM_IR_REQUIRE`
/// names `cxx`).
pub(crate) fn compiler_at_hand() -> bool {
    match available() {
        Ok(()) => true,
        Err(e) => {
            ir_core::testing::skip("cxx", &format!("the emulated GPU cannot build programs: {e}"));
            false
        }
    }
}

/// A block reduction as the shared kernels write it: a warp tree of xor shuffles, the warps'
/// partial sums through shared memory after a barrier, one row per block.
const REDUCE: &str = r#"
extern "C" __global__ void row_sum(float* out, const float* x, int n) {
    __shared__ float partial[64];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[(long long)blockIdx.x * n + i];
    for (int m = warpSize / 2; m > 0; m /= 2) s += SHUFFLE(s, m);
    if (threadIdx.x % warpSize == 0) partial[threadIdx.x / warpSize] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int w = 0; w < (int)(blockDim.x / warpSize); ++w) t += partial[w];
        out[blockIdx.x] = t;
    }
}
extern "C" __global__ void skips_barrier(float* out) {
    if (threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void skips_shuffle(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x != 3) v = SHUFFLE(v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}
"#;

fn reduce_program(dialect: Dialect) -> Arc<EmuProgram> {
    let shuffle = match dialect {
        Dialect::Cuda => "__shfl_xor_sync(0xffffffffu, v, m)",
        Dialect::Hip => "__shfl_xor(v, m)",
    };
    let defines = [("SHUFFLE(v, m)", shuffle.to_owned())];
    EmuProgram::build(dialect, &defines, REDUCE).unwrap_or_else(|e| panic!("{e}"))
}

fn sums(dialect: Dialect, warp: u32, threads: u32) -> (Vec<f32>, Vec<f32>) {
    let program = reduce_program(dialect);
    let (rows, n) = (37usize, 1000usize);
    let x: Vec<f32> = (0..rows * n).map(|i| ((i * 7919) % 1013) as f32 / 64.0).collect();
    let mut out = vec![f32::NAN; rows];
    let args =
        [EmuArg::buffer(out.as_mut_ptr().cast(), 4), EmuArg::buffer(x.as_ptr().cast(), 4), EmuArg::i32(n as i32)];
    let grid = EmuGrid { blocks: rows as u32, threads, warp };
    // SAFETY: `row_sum` reads rows · n floats of x and writes one float per block of out.
    unsafe { program.launch("row_sum", grid, &args) }.unwrap_or_else(|e| panic!("{e}"));
    let expected = x.chunks(n).map(|row| row.iter().sum::<f32>()).collect();
    (out, expected)
}

fn assert_close(got: &[f32], expected: &[f32]) {
    for (row, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!((g - e).abs() <= 1e-3 * e.abs().max(1.0), "row {row}: {g} against {e}");
    }
}

#[test]
fn warp_shuffles_and_barriers_reduce_every_block() {
    if !compiler_at_hand() {
        return;
    }
    let (got, expected) = sums(Dialect::Cuda, 32, 256);
    assert_close(&got, &expected);
    // HIP: waves of 64 lanes, and of 32.
    let (got, expected) = sums(Dialect::Hip, 64, 256);
    assert_close(&got, &expected);
    let (got, expected) = sums(Dialect::Hip, 32, 128);
    assert_close(&got, &expected);
}

#[test]
fn a_barrier_a_thread_never_reaches_is_an_error_not_a_hang() {
    if !compiler_at_hand() {
        return;
    }
    let program = reduce_program(Dialect::Cuda);
    let mut out = vec![0f32; 64];
    let args = [EmuArg::buffer(out.as_mut_ptr().cast(), 4)];
    // SAFETY: the kernel writes at most one float per thread of one block of 64.
    let err = unsafe { program.launch("skips_barrier", EmuGrid { blocks: 1, threads: 64, warp: 32 }, &args) }
        .expect_err("a barrier thread 5 never reaches");
    let message = err.to_string();
    assert!(message.contains("__syncthreads not reached by every thread: 63 of 64"), "{message}");
    assert!(matches!(err, EmuError::Launch { .. }));
}

#[test]
fn a_shuffle_a_lane_never_joins_is_an_error_not_a_hang() {
    if !compiler_at_hand() {
        return;
    }
    let program = reduce_program(Dialect::Cuda);
    let mut out = vec![0f32; 64];
    let args = [EmuArg::buffer(out.as_mut_ptr().cast(), 4)];
    // SAFETY: as above.
    let err = unsafe { program.launch("skips_shuffle", EmuGrid { blocks: 1, threads: 64, warp: 32 }, &args) }
        .expect_err("lane 3 skips the shuffle");
    let message = err.to_string();
    assert!(
        message.contains("warp 0: lane 0 waits at a shuffle that lane 3 never joins (at __syncthreads)"),
        "{message}"
    );
}

#[test]
fn arguments_that_do_not_fit_the_prototype_are_refused_before_any_thread_runs() {
    if !compiler_at_hand() {
        return;
    }
    let program = reduce_program(Dialect::Cuda);
    let mut out = vec![0f32; 1];
    let x = [1u16; 4];
    let grid = EmuGrid { blocks: 1, threads: 32, warp: 32 };
    let cases: [(Vec<EmuArg>, &str); 3] = [
        (vec![EmuArg::buffer(out.as_mut_ptr().cast(), 4)], "the kernel takes 3 arguments, the launch passed 1"),
        (
            vec![EmuArg::buffer(out.as_mut_ptr().cast(), 4), EmuArg::buffer(x.as_ptr().cast(), 2), EmuArg::i32(4)],
            "argument 1: the kernel reads 4-byte elements, the launch passed a buffer of 2-byte ones",
        ),
        (
            vec![EmuArg::buffer(out.as_mut_ptr().cast(), 4), EmuArg::buffer(x.as_ptr().cast(), 4), EmuArg::i64(4)],
            "argument 2: the kernel takes an int, the launch passed a long long",
        ),
    ];
    for (args, expected) in cases {
        // SAFETY: refused before the kernel runs.
        let err = unsafe { program.launch("row_sum", grid, &args) }.expect_err(expected);
        assert!(matches!(&err, EmuError::Arguments { message, .. } if message == expected), "{err}");
    }
    assert_eq!(out, [0.0], "nothing ran");
    // SAFETY: no such kernel.
    let err = unsafe { program.launch("row_mean", grid, &[]) }.expect_err("no such kernel");
    assert!(
        err.to_string().contains("has no kernel `row_mean` (it has: row_sum, skips_barrier, skips_shuffle)"),
        "{err}"
    );
}

/// The shared gated source (`kernels/gpu/gated.h`) for bf16 as NVRTC gets it, after the CPU port.
const GATED_BF16: &str = concat!(
    include_str!("../../kernels/gpu/compute.h"),
    "\n",
    include_str!("../../kernels/gpu/elem.h"),
    "\n",
    include_str!("../../kernels/gpu/gated.h"),
    "\n",
    include_str!("../../kernels/gpu/silu_and_mul.h"),
);

fn bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}
fn from_bf16(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

/// The arguments of a gated bf16 kernel: `rows` compact rows of `2d` elements of x, of `d` of out,
/// no scalar parameters.
fn gated_args(out: *mut u16, x: *const u16, rows: usize, d: usize) -> [EmuArg; 10] {
    [
        EmuArg::buffer(out.cast(), 2),
        EmuArg::buffer(x.cast(), 2),
        EmuArg::i64(rows as i64),
        EmuArg::i32(d as i32),
        EmuArg::i64(2 * d as i64),
        EmuArg::i64(d as i64),
        EmuArg::f32(0.0),
        EmuArg::f32(0.0),
        EmuArg::i32(0),
        EmuArg::i32(0),
    ]
}

#[test]
fn the_shared_gated_source_runs_as_nvrtc_gets_it() {
    if !compiler_at_hand() {
        return;
    }
    let program =
        EmuProgram::build(Dialect::Cuda, &[("DTYPE", "2".to_owned())], GATED_BF16).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(program.kernels(), ["silu_and_mul_bf16", "silu_and_mul_bf16_vec"]);
    let (rows, d) = (5usize, 1000usize);
    let x: Vec<u16> = (0..rows * 2 * d).map(|i| bf16(((i * 37) % 101) as f32 / 16.0 - 3.0)).collect();
    let expected: Vec<u16> = x
        .chunks(2 * d)
        .flat_map(|row| {
            (0..d).map(move |j| {
                let g = from_bf16(row[j]);
                let silu = from_bf16(bf16(g / (1.0 + (-g).exp())));
                bf16(silu * from_bf16(row[d + j]))
            })
        })
        .collect();
    for kernel in ["silu_and_mul_bf16", "silu_and_mul_bf16_vec"] {
        let mut out = vec![0u16; rows * d];
        let args = gated_args(out.as_mut_ptr(), x.as_ptr(), rows, d);
        // SAFETY: rows of 2d elements in x, of d in out (d a multiple of the chunk: both kernels).
        unsafe { program.launch(kernel, EmuGrid { blocks: rows as u32, threads: 128, warp: 32 }, &args) }
            .unwrap_or_else(|e| panic!("{e}"));
        let wrong = out.iter().zip(&expected).filter(|(a, b)| a.abs_diff(**b) > 1).count();
        assert_eq!(wrong, 0, "{kernel}: {wrong} outputs more than one bf16 step from the reference");
    }
}

/// Every family of the shared source in one program, as hipcc gets it (every dtype).
const SHARED_HIP: &str = concat!(
    include_str!("../../kernels/gpu/compute.h"),
    "\n",
    include_str!("../../kernels/gpu/elem.h"),
    "\n",
    include_str!("../../kernels/gpu/fp8.h"),
    "\n",
    include_str!("../../kernels/gpu/quant.h"),
    "\n",
    include_str!("../../kernels/gpu/norm_quant.h"),
    "\n",
    include_str!("../../kernels/gpu/rotary.h"),
    "\n",
    include_str!("../../kernels/gpu/strided_copy.h"),
    "\n",
    include_str!("../../kernels/gpu/strided_convert.h"),
    "\n",
    include_str!("../../kernels/gpu/gated.h"),
    "\n",
    include_str!("../../kernels/gpu/gelu_and_mul.h"),
);

#[test]
fn the_shared_source_builds_as_hipcc_gets_it_and_its_grid_stride_rows_run_in_waves_of_64_and_32() {
    if !compiler_at_hand() {
        return;
    }
    let program = EmuProgram::build(Dialect::Hip, &[], SHARED_HIP).unwrap_or_else(|e| panic!("{e}"));
    let kernels = program.kernels();
    for name in [
        "dynamic_per_token_scaled_fp8_quant_f64",
        "static_scaled_fp8_quant_bf16_vec",
        "norm_quant_wf32_bf16_vec",
        "rotary_embedding_f16",
        "strided_add_f8e4m3fn",
        "gelu_and_mul_f32_vec",
    ] {
        assert!(kernels.contains(&name), "{name} missing from {kernels:?}");
    }
    // Ten rows on three blocks: each block takes rows b, b + 3, ... (`GPU_ROWS`).
    let (rows, hidden) = (10usize, 3000usize);
    let x: Vec<f32> =
        (0..rows * hidden).map(|i| (((i * 7919) % 2003) as f32 - 1001.0) * (1.0 + (i / hidden) as f32)).collect();
    let mut runs = Vec::new();
    for warp in [64, 32] {
        let mut q = vec![0u8; rows * hidden];
        let mut scales = vec![f32::NAN; rows];
        let args = [
            EmuArg::buffer(q.as_mut_ptr(), 1),
            EmuArg::buffer(scales.as_mut_ptr().cast(), 4),
            EmuArg::buffer(x.as_ptr().cast(), 4),
            EmuArg::i64(rows as i64),
            EmuArg::i32(hidden as i32),
            EmuArg::i64(hidden as i64),
            EmuArg::null(),
            EmuArg::i32(0),
            EmuArg::i32(0),
        ];
        let grid = EmuGrid { blocks: 3, threads: 256, warp };
        // SAFETY: rows · hidden elements of x and of q, one scale per row.
        unsafe { program.launch("dynamic_per_token_scaled_fp8_quant_f32", grid, &args) }
            .unwrap_or_else(|e| panic!("{e}"));
        for (row, scale) in scales.iter().enumerate() {
            let absmax = x[row * hidden..][..hidden].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(*scale, (absmax / 448.0).max(1.0 / (448.0 * 512.0)), "row {row}, waves of {warp}");
        }
        runs.push((q, scales));
    }
    assert!(runs[0] == runs[1], "waves of 64 and of 32 give the same bits");
}

#[test]
fn a_misaligned_16_byte_access_fails_the_launch_as_it_faults_on_a_gpu() {
    if !compiler_at_hand() {
        return;
    }
    if !checks_chunk_alignment() {
        return ir_core::testing::skip(
            "gcc",
            "the C++ compiler's alignment check misses 16-byte chunk loads (not GCC)",
        );
    }
    let program =
        EmuProgram::build(Dialect::Cuda, &[("DTYPE", "2".to_owned())], GATED_BF16).unwrap_or_else(|e| panic!("{e}"));
    let (rows, d) = (3usize, 64usize);
    // One element more than the rows need, so the rows can start one element (2 bytes) in.
    let x: Vec<u16> = (0..rows * 2 * d + 8).map(|i| bf16((i % 7) as f32)).collect();
    let shifted = x[1..].as_ptr();
    assert_ne!(shifted as usize % 16, 0);
    for kernel in ["silu_and_mul_bf16", "silu_and_mul_bf16_vec"] {
        let mut out = vec![0u16; rows * d];
        let args = gated_args(out.as_mut_ptr(), shifted, rows, d);
        // SAFETY: rows of 2d elements from `shifted`, inside x; rows of d in out.
        let result = unsafe { program.launch(kernel, EmuGrid { blocks: rows as u32, threads: 64, warp: 32 }, &args) };
        if kernel.ends_with("_vec") {
            let err = result.expect_err("a 16-byte load from an address 2 bytes past a multiple of 16");
            let message = err.to_string();
            assert!(
                matches!(err, EmuError::Launch { .. })
                    && message.contains("misaligned access")
                    && message.contains("16-byte alignment"),
                "{message}"
            );
        } else {
            // Element accesses need 2-byte alignment only: the scalar kernel takes the same rows.
            result.unwrap_or_else(|e| panic!("{kernel}: {e}"));
        }
    }
}
