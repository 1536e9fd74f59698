//! The host code run over a runtime that records each launch: argument lists, grids and the
//! 16-byte path checked for every backend without a device.

use ir_core::op::Value;
use ir_core::storage::{BinaryOp, DeviceBuffer, Storage};
use ir_core::{DType, KernelError, Tensor, UniqueTensor};

use super::*;
use crate::{
    ComputeScalar, GatedKernel, NormQuantCall, NormQuantResidual, RotaryCall, RotaryLaunch, Rows, device_buffer,
};

#[test]
fn grids_past_each_backend_limit_are_errors_naming_what_they_count_or_capped_on_hip() {
    let grid = |groups: usize, group_size: u32| Grid { groups, group_size, what: "rows", grid_stride: true };
    assert_eq!(grid(i32::MAX as usize, 256).cuda_blocks().unwrap(), i32::MAX as u32);
    assert!(matches!(
        grid(i32::MAX as usize + 1, 256).cuda_blocks(),
        Err(KernelError::GridLimit { what: "rows", count }) if count == i32::MAX as usize + 1
    ));
    // HIP: 2^24 rows of 256 work-items is 2^32 work-items, one past the limit: capped, and the
    // kernels' grid-stride loops cover the rest.
    assert_eq!(grid((1 << 24) - 1, 256).hip_blocks().unwrap(), (1 << 24) - 1);
    assert_eq!(grid(1 << 24, 256).hip_blocks().unwrap(), (1 << 24) - 1);
    assert_eq!(grid(1 << 32, 1).hip_blocks().unwrap(), i32::MAX as u32);
    assert!(matches!(grid(5, 0).hip_blocks(), Err(KernelError::GridLimit { what: "rows", .. })));
    // A kernel without the loop (the norms) is refused past the limit instead.
    let norm = Grid { grid_stride: false, ..grid(1 << 24, 256) };
    assert!(matches!(norm.hip_blocks(), Err(KernelError::GridLimit { what: "rows", .. })));
    assert_eq!(Grid { grid_stride: false, ..grid((1 << 24) - 1, 256) }.hip_blocks().unwrap(), (1 << 24) - 1);
    assert_eq!(grid(1 << 24, 256).global_work_size().unwrap(), 1 << 32);
    assert!(grid(usize::MAX, 2).global_work_size().is_err());
}

/// The groups a HIP kernel's grid-stride loop (`for (g = blockIdx.x; g < groups; g += gridDim.x)`)
/// visits in each block of a launch of `blocks` blocks: every group once, by exactly one block.
fn grid_stride_visits(groups: u64, blocks: u64) -> Vec<u64> {
    let mut visits = vec![0; groups as usize];
    for block in 0..blocks {
        let mut g = block;
        while g < groups {
            visits[g as usize] += 1;
            g += blocks;
        }
    }
    visits
}

#[test]
fn capped_hip_grids_cover_every_group_with_their_grid_stride_loops() {
    // Past 2^32 work-items: a strided copy of 5 Gi elements in blocks of 256 (one element per
    // work-item), 20 Mi gated rows of 256 threads and 8 Gi rows of a 1-thread group.
    for (groups, group_size) in [(5usize << 30 >> 8, 256u32), (20 << 20, 256), (8 << 30, 1), (1 << 40, 1024)] {
        let grid = Grid { groups, group_size, what: "elements", grid_stride: true };
        let blocks = u64::from(grid.hip_blocks().unwrap());
        assert!(blocks * u64::from(group_size) <= u64::from(u32::MAX), "{groups} × {group_size}: {blocks} blocks");
        assert!(blocks <= i32::MAX as u64 && blocks <= groups as u64);
        // Each block takes ⌈groups / blocks⌉ or one fewer: the last block's share is bounded.
        let per_block = (groups as u64).div_ceil(blocks);
        assert!(per_block * blocks >= groups as u64 && (per_block - 1) * blocks < groups as u64);
    }
    // The loop itself, at sizes a test can walk: each group exactly once, whatever the cap.
    for (groups, blocks) in [(1000, 7), (1000, 1000), (1000, 1), (3, 8)] {
        let blocks = blocks.min(groups);
        assert!(grid_stride_visits(groups, blocks).iter().all(|&v| v == 1), "{groups} groups, {blocks} blocks");
    }
}

/// Describes each argument as a backend would pass it.
fn describe(args: KernelArgs<'_, u8>) -> Result<Vec<String>, KernelError> {
    let resolved = args.resolve(|arg| {
        Ok(match arg {
            BufferArg::Read { buffer, offset, element_size } => format!("read {buffer} {offset} {element_size}"),
            BufferArg::Write { buffer, offset, element_size } => format!("write {buffer} {offset} {element_size}"),
            BufferArg::Null => "null".to_owned(),
        })
    })?;
    Ok(resolved
        .into_iter()
        .map(|r| match r {
            Resolved::Buffer(b) => b,
            Resolved::Scalar(s) => format!("{s:?}"),
        })
        .collect())
}

#[test]
fn arguments_keep_prototype_order_and_types() {
    let (a, mut b) = (1u8, 2u8);
    let mut args = KernelArgs::new();
    args.alias(1)
        .read(&a, 3, DType::BF16)
        .write(&mut b, 4, DType::F32)
        .null()
        .int(5)
        .long(6)
        .compute(ComputeScalar::new(DType::F64, 0.5))
        .compute(ComputeScalar::new(DType::BF16, 0.5))
        .alias(2);
    assert_eq!(args.len(), 9);
    assert_eq!(
        describe(args).unwrap(),
        ["read 1 3 2", "read 1 3 2", "write 2 4 4", "null", "I32(5)", "I64(6)", "F64(0.5)", "F32(0.5)", "write 2 4 4"]
    );
}

#[test]
fn an_alias_must_name_a_buffer() {
    for (position, of) in [(1, 0), (1, 1), (1, 7), (2, 1)] {
        let mut args = KernelArgs::<u8>::new();
        args.int(0);
        for _ in 1..position {
            args.alias(1);
        }
        args.alias(of);
        let error = describe(args).unwrap_err().to_string();
        assert!(error.contains("not a buffer"), "alias at {position} of {of}: {error}");
    }
}

/// Host memory standing in for a device's: lets the family host code run without a device.
#[derive(Debug)]
struct HostBuffer(Vec<u8>, usize);

impl DeviceBuffer for HostBuffer {
    fn device(&self) -> ir_core::Device {
        ir_core::Device::Cuda(0)
    }
    fn len_bytes(&self) -> usize {
        self.0.len()
    }
    fn download(&self, dst: &mut [u8]) -> Result<(), ir_core::storage::DeviceError> {
        dst.copy_from_slice(&self.0);
        Ok(())
    }
    fn upload(&mut self, src: &[u8]) -> Result<(), ir_core::storage::DeviceError> {
        self.0[..src.len()].copy_from_slice(src);
        Ok(())
    }
    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, ir_core::storage::DeviceError> {
        Ok(Box::new(HostBuffer(vec![0; len_bytes], 256)))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// What one launch was given.
#[derive(Debug, PartialEq)]
struct Launched {
    symbol: String,
    grid: Grid,
    args: Vec<String>,
}

thread_local! {
    static LAUNCHES: std::cell::RefCell<Vec<Launched>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A runtime that records each launch instead of running it.
struct Recorder;

impl GpuRuntime for Recorder {
    const MEMORY: &'static str = "host-standing-in";
    const QUANT_GROUP: u32 = 32;
    const COPY_GROUP: u32 = 16;
    type Buffer = HostBuffer;
    type Queue = ();
    type Kernel = String;

    fn gated_group(d: usize, dtype: DType) -> u32 {
        crate::gated_block(d, dtype)
    }
    fn queue(_first: &HostBuffer) -> Result<(), KernelError> {
        Ok(())
    }
    fn allocate(_like: &HostBuffer, _queue: &(), len_bytes: usize) -> Result<HostBuffer, KernelError> {
        Ok(HostBuffer(vec![0; len_bytes], 256))
    }
    fn kernel(_like: &HostBuffer, key: KernelKey<'_>) -> Result<String, KernelError> {
        Ok(key.symbol())
    }
    fn norm_kernel(_like: &HostBuffer, key: &NormKey) -> Result<(String, NormShape), KernelError> {
        let NormKey { op, dtype, weight, vectorized, hidden } = key;
        let symbol = format!("{}_{dtype}_w{weight:?}_v{vectorized}_h{hidden}", op.name());
        Ok((symbol, NormShape { group_size: 128, rows_per_group: 4 }))
    }
    fn base_alignment(buffer: &HostBuffer) -> usize {
        buffer.1
    }
    fn strided_kernel(_like: &HostBuffer, key: StridedKey) -> Result<Option<String>, KernelError> {
        // No f64 conversions here, as on an OpenCL device without f64.
        let through_f64 = matches!(key, StridedKey::Convert { src: DType::F64, .. });
        Ok(key.symbol().filter(|_| !through_f64).map(str::to_owned))
    }
    unsafe fn copy_bytes(
        _queue: &(),
        from: &HostBuffer,
        from_offset: usize,
        to: &mut HostBuffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        to.0[to_offset..to_offset + bytes].copy_from_slice(&from.0[from_offset..from_offset + bytes]);
        let args = vec![format!("{} bytes @{from_offset} -> @{to_offset}: {bytes}", from.0.len())];
        let grid = Grid { groups: 0, group_size: 0, what: "bytes", grid_stride: false };
        LAUNCHES.with(|l| l.borrow_mut().push(Launched { symbol: "copy_bytes".to_owned(), grid, args }));
        Ok(())
    }
    fn buffer_queue(_buffer: &HostBuffer) {}
    fn same_device(_a: &HostBuffer, _b: &HostBuffer) -> bool {
        true
    }
    unsafe fn launch(
        _queue: &(),
        kernel: &String,
        grid: Grid,
        args: KernelArgs<'_, HostBuffer>,
    ) -> Result<(), KernelError> {
        let args = args
            .resolve(|arg| {
                Ok(match arg {
                    BufferArg::Read { buffer, offset, element_size } => {
                        format!("read {} bytes @{offset}x{element_size}", buffer.0.len())
                    }
                    BufferArg::Write { buffer, offset, element_size } => {
                        format!("write {} bytes @{offset}x{element_size}", buffer.0.len())
                    }
                    BufferArg::Null => "null".to_owned(),
                })
            })?
            .into_iter()
            .map(|r| match r {
                Resolved::Buffer(b) => b,
                Resolved::Scalar(s) => format!("{s:?}"),
            })
            .collect();
        LAUNCHES.with(|l| l.borrow_mut().push(Launched { symbol: kernel.clone(), grid, args }));
        Ok(())
    }
}

fn on_host(dtype: DType, shape: &[usize], strides: &[usize], offset: usize, len: usize) -> Tensor {
    on_host_at(256, dtype, shape, strides, offset, len)
}

/// A tensor over memory whose first byte has `alignment`.
fn on_host_at(alignment: usize, dtype: DType, shape: &[usize], strides: &[usize], offset: usize, len: usize) -> Tensor {
    let layout = ir_core::Layout::new(shape, strides, offset).unwrap();
    let buffer = HostBuffer(vec![0; len * dtype.size_in_bytes()], alignment);
    Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, layout).unwrap()
}

fn take_launches() -> Vec<Launched> {
    LAUNCHES.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

#[test]
fn gated_host_code_passes_the_prototype_for_a_strided_x() {
    // Three rows of 2d = 8 elements, 10 apart, from element 2 of a 40-element buffer.
    let x = on_host(DType::BF16, &[3, 8], &[10, 1], 2, 40);
    let op = GatedKernel { def: &ir_ops::gelu_and_mul::GELU_AND_MUL, source: "" };
    let out = run_gated::<Recorder>(&op, &[Value::Tensor(x), Value::Str("tanh".to_owned())]).unwrap();
    assert_eq!(out.shape(), [3, 4]);
    assert!(out.layout().is_compact_at_zero());
    let launches = take_launches();
    assert_eq!(
        launches,
        [Launched {
            symbol: "gelu_and_mul_bf16".to_owned(),
            grid: Grid { groups: 3, group_size: 64, what: "rows", grid_stride: true },
            args: [
                "write 24 bytes @0x2",
                "read 80 bytes @2x2",
                "I64(3)",
                "I32(4)",
                "I64(10)",
                "I64(4)",
                "F32(0.0)",
                "F32(0.0)",
                "I32(1)",
                "I32(0)",
            ]
            .map(str::to_owned)
            .to_vec(),
        }]
    );
    // Nothing to compute: an output, no launch.
    let empty = on_host(DType::F32, &[0, 8], &[8, 1], 0, 0);
    let op = GatedKernel { def: &ir_ops::silu_and_mul::SILU_AND_MUL, source: "" };
    assert_eq!(run_gated::<Recorder>(&op, &[Value::Tensor(empty)]).unwrap().shape(), [0, 4]);
    assert!(take_launches().is_empty());
}

#[test]
fn gated_rows_take_the_16_byte_kernel_only_where_every_access_is_aligned() {
    let op = GatedKernel { def: &ir_ops::silu_and_mul::SILU_AND_MUL, source: "" };
    let launch = |x: Tensor| {
        run_gated::<Recorder>(&op, &[Value::Tensor(x)]).unwrap();
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        (launches[0].symbol.clone(), launches[0].grid.group_size)
    };
    // bf16 rows of d = 1024: 128 chunks, one step of two per thread.
    let aligned = on_host(DType::BF16, &[3, 2048], &[2048, 1], 0, 3 * 2048);
    assert_eq!(launch(aligned), ("silu_and_mul_bf16_vec".to_owned(), 64));
    // Rows starting 16 bytes in: still aligned.
    let shifted = on_host(DType::BF16, &[3, 2048], &[2056, 1], 8, 3 * 2056 + 8);
    assert_eq!(launch(shifted), ("silu_and_mul_bf16_vec".to_owned(), 64));
    // A start 2 bytes off 16, or a row stride that is not a multiple of 8 elements: scalar, the
    // same block (the width alone picks it, so both kernels give the same bits).
    let offset = on_host(DType::BF16, &[3, 2048], &[2048, 1], 1, 3 * 2048 + 1);
    assert_eq!(launch(offset), ("silu_and_mul_bf16".to_owned(), 64));
    let stride = on_host(DType::BF16, &[3, 2048], &[2052, 1], 0, 3 * 2052);
    assert_eq!(launch(stride), ("silu_and_mul_bf16".to_owned(), 64));
    // Adopted memory at an address 2 bytes past a 16-byte boundary never takes the 16-byte path,
    // whatever the offset.
    let adopted = on_host_at(2, DType::BF16, &[3, 2048], &[2048, 1], 0, 3 * 2048);
    assert_eq!(launch(adopted), ("silu_and_mul_bf16".to_owned(), 64));
    // d not a multiple of the chunk (each row's up half starts unaligned): scalar.
    let odd = on_host(DType::F32, &[2, 2 * 1030], &[2 * 1030, 1], 0, 4 * 1030);
    assert_eq!(launch(odd), ("silu_and_mul_f32".to_owned(), 256));
    // Llama's d = 14336 in bf16: 1792 chunks, the largest block; f64 rows stay scalar (d = 4096:
    // 2048 chunks, the largest block).
    let wide = on_host(DType::BF16, &[1, 2 * 14336], &[2 * 14336, 1], 0, 2 * 14336);
    assert_eq!(launch(wide), ("silu_and_mul_bf16_vec".to_owned(), 1024));
    let reference = on_host(DType::F64, &[1, 2 * 4096], &[2 * 4096, 1], 0, 2 * 4096);
    assert_eq!(launch(reference), ("silu_and_mul_f64".to_owned(), 1024));
}

#[test]
fn rotary_host_code_passes_offsets_and_a_null_key() {
    let positions = on_host(DType::I64, &[2], &[1], 1, 3);
    // Two tokens of 2 heads × 4, rows 12 apart from element 4; a cache of 16 rows of 4.
    let query = on_host(DType::F16, &[2, 8], &[12, 1], 4, 28);
    let cache = on_host(DType::F16, &[16, 4], &[4, 1], 0, 64);
    let launch = RotaryLaunch::of(&positions, &query, None, &cache, 4, 4, true).unwrap();
    let query = UniqueTensor::new(query).unwrap();
    let call =
        RotaryCall { positions: &positions, query, key: None, cos_sin_cache: &cache, launch, round_products: true };
    let (q, k) = run_rotary::<Recorder>(call).unwrap();
    assert_eq!((q.offset(), k.is_none()), (4, true));
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    assert_eq!(launches[0].symbol, "rotary_embedding_f16");
    assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 32, what: "tokens", grid_stride: true });
    let expected = [
        "write 56 bytes @4x2",
        "I64(12)",
        "null",
        "I64(0)",
        "I32(0)",
        "read 24 bytes @1x8",
        "read 128 bytes @0x2",
        "I64(4)",
        "I64(2)",
        "I32(2)",
        "I32(0)", // no key heads
        "I32(4)",
        "I32(4)",
        "I32(16)",
        "I32(1)",
        "I32(1)",
    ];
    assert_eq!(launches[0].args, expected.map(str::to_owned));
}

#[test]
fn norm_quant_in_place_writes_the_sum_through_the_residual_itself() {
    // Two rows of 8, x compact, the residual padded to rows of 12; a static scale at offset 1.
    let x = on_host(DType::F16, &[2, 8], &[8, 1], 0, 16);
    let residual = on_host(DType::F16, &[2, 8], &[12, 1], 0, 20);
    let weight = on_host(DType::F16, &[8], &[1], 0, 8);
    let scale = on_host(DType::F32, &[1], &[1], 1, 2);
    let mut residual = UniqueTensor::new(residual).unwrap();
    let call = NormQuantCall {
        x: &x,
        residual: Some(NormQuantResidual::InPlace(&mut residual)),
        weight: Some(&weight),
        epsilon: 1e-6,
        scale: Some(&scale),
        dynamic: false,
        out_dtype: DType::F8E4M3FN,
        rounding: ir_ops::Rounding::Dtype,
    };
    let outputs = run_norm_quant::<Recorder>(call).unwrap();
    assert!(outputs.residual_out.is_none() && outputs.scales.is_none());
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    assert_eq!(launches[0].symbol, "norm_quant_f16");
    assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 32, what: "rows", grid_stride: true });
    let expected = [
        "write 16 bytes @0x1", // q
        "null",                // no scales
        "write 40 bytes @0x2", // the residual output: the residual's own rows
        "read 32 bytes @0x2",  // x
        "write 40 bytes @0x2", // the residual
        "read 16 bytes @0x2",  // the weight
        "I64(2)",
        "I32(8)",
        "I64(8)",
        "I64(12)",
        "I64(12)", // the output's rows are the residual's
        "F32(1e-6)",
        "read 8 bytes @1x4", // the scale
        "I32(1)",
        "I32(1)",
        "I32(0)",
        "I32(1)",
        "I32(0)", // e4m3
        "I32(1)", // `dtype` rounding of an f16 sum: the norm reads it rounded
        "I32(1)", // and the static scale's reciprocal multiplies
    ];
    assert_eq!(launches[0].args, expected.map(str::to_owned));
}

#[test]
fn quantizations_take_the_16_byte_kernels_only_where_every_row_allows_it() {
    let symbol = || {
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        launches[0].symbol.clone()
    };
    let scale = on_host(DType::F32, &[1], &[1], 0, 1);
    let static_quant = |x: Tensor| {
        run_static_quant::<Recorder>(&x, &scale, DType::F8E4M3FN, ir_ops::Rounding::Exact).unwrap();
        symbol()
    };
    assert_eq!(static_quant(on_host(DType::BF16, &[4, 64], &[64, 1], 0, 256)), "static_scaled_fp8_quant_bf16_vec");
    // Rows 2 bytes off 16, memory at an address 2 bytes off, a width that is not a whole chunk.
    assert_eq!(static_quant(on_host(DType::BF16, &[4, 64], &[64, 1], 1, 257)), "static_scaled_fp8_quant_bf16");
    assert_eq!(static_quant(on_host_at(2, DType::BF16, &[4, 64], &[64, 1], 0, 256)), "static_scaled_fp8_quant_bf16");
    assert_eq!(static_quant(on_host(DType::BF16, &[4, 60], &[60, 1], 0, 240)), "static_scaled_fp8_quant_bf16");
    run_dynamic_quant::<Recorder>(&on_host(DType::F32, &[3, 32], &[32, 1], 0, 96), None, DType::F8E5M2).unwrap();
    assert_eq!(symbol(), "dynamic_per_token_scaled_fp8_quant_f32_vec");
    run_dynamic_quant::<Recorder>(&on_host(DType::F64, &[3, 32], &[32, 1], 0, 96), None, DType::F8E5M2).unwrap();
    assert_eq!(symbol(), "dynamic_per_token_scaled_fp8_quant_f64", "f64 has no 16-byte kernel");

    // The norm + quantization also needs the residual's rows and the weight aligned.
    let x = on_host(DType::BF16, &[2, 64], &[64, 1], 0, 128);
    let norm_quant = |residual: Tensor, weight: &Tensor, in_place: bool| {
        let (mut unique, read);
        let residual = if in_place {
            unique = UniqueTensor::new(residual).unwrap();
            NormQuantResidual::InPlace(&mut unique)
        } else {
            read = residual;
            NormQuantResidual::Read(&read)
        };
        let call = NormQuantCall {
            x: &x,
            residual: Some(residual),
            weight: Some(weight),
            epsilon: 1e-6,
            scale: None,
            dynamic: true,
            out_dtype: DType::F8E4M3FN,
            rounding: ir_ops::Rounding::Dtype,
        };
        run_norm_quant::<Recorder>(call).unwrap();
        symbol()
    };
    let residual = || on_host(DType::BF16, &[2, 64], &[72, 1], 8, 152);
    let weight = on_host(DType::BF16, &[64], &[1], 0, 64);
    assert_eq!(norm_quant(residual(), &weight, false), "norm_quant_bf16_vec");
    assert_eq!(norm_quant(residual(), &weight, true), "norm_quant_bf16_vec");
    let odd_weight = on_host(DType::BF16, &[64], &[1], 3, 67);
    assert_eq!(norm_quant(residual(), &odd_weight, false), "norm_quant_bf16");
    let odd_residual = on_host(DType::BF16, &[2, 64], &[68, 1], 0, 132);
    assert_eq!(norm_quant(odd_residual, &weight, true), "norm_quant_bf16");
    // A weight of another dtype has its own kernel, read element by element: its alignment does not
    // matter, and it is passed as its own dtype (64 f32 values from element 3).
    let f32_weight = on_host_at(4, DType::F32, &[64], &[1], 3, 67);
    assert_eq!(norm_quant(residual(), &f32_weight, true), "norm_quant_wf32_bf16_vec");
    let x = on_host(DType::BF16, &[2, 64], &[64, 1], 0, 128);
    let call = NormQuantCall {
        x: &x,
        residual: None,
        weight: Some(&f32_weight),
        epsilon: 1e-6,
        scale: None,
        dynamic: true,
        out_dtype: DType::F8E4M3FN,
        rounding: ir_ops::Rounding::Exact,
    };
    run_norm_quant::<Recorder>(call).unwrap();
    let launches = take_launches();
    assert_eq!(launches[0].symbol, "norm_quant_wf32_bf16_vec");
    assert_eq!(launches[0].args[5], "read 268 bytes @3x4", "the weight as f32 from its offset");
}

#[test]
fn dynamic_quant_of_empty_rows_gives_floor_scales_without_a_launch() {
    let x = on_host(DType::BF16, &[3, 0], &[0, 1], 0, 0);
    let (q, scales) = run_dynamic_quant::<Recorder>(&x, None, DType::F8E5M2).unwrap();
    assert_eq!((q.shape(), scales.shape()), (&[3, 0][..], &[3, 1][..]));
    assert!(take_launches().is_empty());
}

#[test]
fn rms_norm_takes_the_vector_path_only_where_every_address_allows_it() {
    let weight = on_host(DType::BF16, &[64], &[1], 0, 64);
    for (alignment, offset, stride, vectorized) in
        [(256, 0, 64, true), (256, 8, 72, true), (256, 2, 64, false), (8, 0, 64, false), (256, 0, 66, false)]
    {
        let x = on_host_at(alignment, DType::BF16, &[5, 64], &[stride, 1], offset, offset + 5 * stride);
        let out = run_rms_norm::<Recorder>(&x, Some(&weight), 1e-6, None).unwrap();
        assert_eq!(out.shape(), [5, 64]);
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        let label = format!("alignment {alignment}, offset {offset}, stride {stride}");
        assert_eq!(launches[0].symbol, format!("rms_norm_bf16_wSome(BF16)_v{vectorized}_h64"), "{label}");
        assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 128, what: "rows", grid_stride: false }, "{label}");
        let expected = [
            "write 640 bytes @0x2".to_owned(),
            format!("read {} bytes @{offset}x2", (offset + 5 * stride) * 2),
            "read 128 bytes @0x2".to_owned(),
            "F32(1e-6)".to_owned(),
            "I64(5)".to_owned(),
            "I32(64)".to_owned(),
            "I32(64)".to_owned(),
            format!("I64({stride})"),
            "I64(64)".to_owned(),
        ];
        assert_eq!(launches[0].args, expected, "{label}");
    }
    // A weight of another dtype is read with scalar loads either way; one of x's dtype must be
    // aligned too.
    let x = on_host(DType::BF16, &[5, 64], &[64, 1], 0, 320);
    let misaligned = on_host_at(2, DType::BF16, &[64], &[1], 0, 64);
    run_rms_norm::<Recorder>(&x, Some(&misaligned), 1e-6, None).unwrap();
    let f32_weight = on_host_at(4, DType::F32, &[64], &[1], 0, 64);
    run_rms_norm::<Recorder>(&x, Some(&f32_weight), 1e-6, Some(32)).unwrap();
    let launches = take_launches();
    assert!(launches[0].symbol.ends_with("_vfalse_h64"), "{}", launches[0].symbol);
    assert_eq!(launches[1].symbol, "rms_norm_bf16_wSome(F32)_vtrue_h64");
    assert_eq!(launches[1].args[6], "I32(32)", "variance_size");
}

#[test]
fn fused_add_rms_norm_with_dtype_rounding_normalizes_the_stored_sum_in_a_second_launch() {
    let x = UniqueTensor::new(on_host(DType::F16, &[3, 16], &[16, 1], 0, 48)).unwrap();
    let residual = UniqueTensor::new(on_host(DType::F16, &[3, 16], &[24, 1], 8, 80)).unwrap();
    let (x, residual) = run_fused_add_rms_norm::<Recorder>(x, residual, None, 1e-5, None, true).unwrap();
    assert_eq!((x.offset(), residual.offset()), (0, 8));
    let launches = take_launches();
    let symbols: Vec<&str> = launches.iter().map(|l| l.symbol.as_str()).collect();
    assert_eq!(symbols, ["fused_add_rms_norm_f16_wNone_vtrue_h16", "rms_norm_f16_wNone_vtrue_h16"]);
    let buffers = |l: &Launched| (l.args[..3].to_vec(), l.args[7..].to_vec());
    let fused = ["write 96 bytes @0x2", "write 160 bytes @8x2", "null"].map(str::to_owned).to_vec();
    assert_eq!(buffers(&launches[0]), (fused, vec!["I64(16)".to_owned(), "I64(24)".to_owned()]));
    // The norm of the sum: into x, from the residual, strides in (x, out) order.
    let norm = ["write 96 bytes @0x2", "read 160 bytes @8x2", "null"].map(str::to_owned).to_vec();
    assert_eq!(buffers(&launches[1]), (norm, vec!["I64(24)".to_owned(), "I64(16)".to_owned()]));
}

#[test]
fn address_alignment_is_the_largest_power_of_two_up_to_256() {
    assert_eq!(address_alignment(0x7f00_1234_5602), 2);
    assert_eq!(address_alignment(0x7f00_1234_5610), 16);
    assert_eq!(address_alignment(0x7f00_1234_5600), 256);
    assert_eq!(address_alignment(0), 256);
    let rows = Rows { n_rows: 4, hidden: 4096, row_stride: 4096, offset: 0 };
    assert!(!vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5602)), "2 bytes past alignment");
    assert!(!vector_ok(&rows, DType::F32, address_alignment(0x7f00_1234_5608)), "8-byte aligned only");
    assert!(vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5610)));
    assert!(!vector_ok(&rows, DType::F64, 256), "f64 rows launch with scalar accesses");
    assert!(!vector_ok(&rows, DType::F32, 0), "a backend without a host-chosen vector path");
    // A misaligned base made good by the offset is not taken.
    assert!(!vector_ok(&Rows { offset: 1, ..rows }, DType::BF16, address_alignment(0x7f00_1234_560e)));
    assert!(!vector_ok(&Rows { hidden: 4095, ..rows }, DType::BF16, 256), "H not a multiple of 8");
    assert!(!vector_ok(&Rows { row_stride: 4099, ..rows }, DType::BF16, 256), "row stride");
    assert!(vector_ok(&Rows { row_stride: 4100, offset: 4, ..rows }, DType::F32, 256));
}

fn storage_of(t: &mut Tensor) -> &mut dyn DeviceBuffer {
    match t.storage_mut().unwrap() {
        Storage::Device(buffer) => buffer.as_mut(),
        Storage::Cpu(_) => unreachable!("made on the recording runtime"),
    }
}

fn buffer_of(t: &Tensor) -> &HostBuffer {
    device_buffer::<HostBuffer>(t, "t", "host").unwrap()
}

#[test]
fn strided_copies_conversions_and_binaries_pass_rank_dims_and_offsets() {
    // A transposed [4, 6] f16 view from element 2: no dimension merges, rank 2.
    let src = on_host(DType::F16, &[4, 6], &[1, 4], 2, 26);
    let mut dst = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
    let pad = |v: &[i64], fill: i64| std::array::from_fn::<i64, 8, _>(|k| v.get(k).copied().unwrap_or(fill));
    let dims = format!(
        "I64(24) I32(2) {:?} {:?} {:?}",
        Scalar::I64x8(pad(&[4, 6], 1)),
        Scalar::I64x8(pad(&[1, 4], 0)),
        Scalar::I64x8(pad(&[6, 1], 0))
    );
    let dst_layout = dst.layout().clone();
    copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &dst_layout).unwrap();
    let meta = dst.meta().clone();
    let converted =
        convert_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &meta, Some(0.5)).unwrap();
    assert!(converted);
    let b = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
    let op = BinaryOp::Mul;
    let added = binary_strided::<Recorder>(
        buffer_of(&src),
        src.meta(),
        buffer_of(&b),
        b.meta(),
        op,
        storage_of(&mut dst),
        &meta,
    )
    .unwrap();
    assert!(added);
    let launches = take_launches();
    let symbols: Vec<&str> = launches.iter().map(|l| l.symbol.as_str()).collect();
    assert_eq!(symbols, ["strided_copy_2", "strided_convert_f16_f16", "strided_mul_f16"]);
    for launch in &launches {
        assert_eq!(
            launch.grid,
            Grid { groups: 2, group_size: 16, what: "elements", grid_stride: true },
            "{}",
            launch.symbol
        );
    }
    let args = |l: &Launched, buffers: usize| (l.args[..buffers].join(" "), l.args[buffers..buffers + 5].join(" "));
    assert_eq!(args(&launches[0], 2), ("read 52 bytes @2x2 write 48 bytes @0x2".to_owned(), dims.clone()));
    assert_eq!(&launches[1].args[7..], ["F32(0.5)", "I32(1)"]);
    assert_eq!(
        args(&launches[2], 3),
        ("read 52 bytes @2x2 read 48 bytes @0x2 write 48 bytes @0x2".to_owned(), dims.clone())
    );
    // No kernel for the pair: nothing launched, the caller converts on the host.
    let wide = on_host(DType::F64, &[4, 6], &[6, 1], 0, 24);
    let none = convert_strided::<Recorder>(buffer_of(&wide), wide.meta(), storage_of(&mut dst), &meta, None);
    assert!(!none.unwrap());
    // Nothing to copy: no launch.
    let empty = on_host(DType::F16, &[0, 6], &[6, 1], 0, 0);
    let mut empty_dst = on_host(DType::F16, &[0, 6], &[6, 1], 0, 0);
    let layout = empty_dst.layout().clone();
    copy_strided::<Recorder>(buffer_of(&empty), empty.meta(), storage_of(&mut empty_dst), &layout).unwrap();
    assert!(take_launches().is_empty());
}

#[test]
fn a_copy_of_one_compact_range_into_another_is_a_memcpy() {
    // A compact [4, 6] f16 view from element 2, into a compact destination: 48 bytes.
    let mut src = on_host(DType::F16, &[4, 6], &[6, 1], 2, 26);
    if let Storage::Device(buffer) = src.storage_mut().unwrap() {
        buffer.upload(&(0..52).collect::<Vec<u8>>()).unwrap();
    }
    let mut dst = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
    let layout = dst.layout().clone();
    copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &layout).unwrap();
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    assert_eq!((launches[0].symbol.as_str(), launches[0].args[0].as_str()), ("copy_bytes", "52 bytes @4 -> @0: 48"));
    assert_eq!(buffer_of(&dst).0, (4..52).collect::<Vec<u8>>(), "the bytes moved");
    // Into row-padded rows, or converting: kernels, not a memcpy.
    let mut padded = on_host(DType::F16, &[4, 6], &[8, 1], 0, 32);
    let layout = padded.layout().clone();
    copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut padded), &layout).unwrap();
    let meta = dst.meta().clone();
    convert_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &meta, None).unwrap();
    let symbols: Vec<String> = take_launches().into_iter().map(|l| l.symbol).collect();
    assert_eq!(symbols, ["strided_copy_2", "strided_convert_f16_f16"]);
}

#[test]
fn copies_of_rows_contiguous_on_both_sides_move_16_byte_units() {
    // Rows 8 bf16 wide (16 bytes) of a [3, 16] buffer, from element 8, into compact rows: the
    // units are one per row, the source stride 2 units, and the offsets are in units too.
    let src = on_host(DType::BF16, &[3, 8], &[16, 1], 8, 48);
    let mut dst = on_host(DType::BF16, &[3, 8], &[8, 1], 0, 24);
    let layout = dst.layout().clone();
    copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &layout).unwrap();
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    let pad = |v: &[i64], fill: i64| std::array::from_fn::<i64, 8, _>(|k| v.get(k).copied().unwrap_or(fill));
    let expected = [
        "read 96 bytes @1x16".to_owned(),
        "write 48 bytes @0x16".to_owned(),
        "I64(3)".to_owned(),
        "I32(2)".to_owned(),
        format!("{:?}", Scalar::I64x8(pad(&[3, 1], 1))),
        format!("{:?}", Scalar::I64x8(pad(&[2, 1], 0))),
        format!("{:?}", Scalar::I64x8(pad(&[1, 1], 0))),
    ];
    assert_eq!((launches[0].symbol.as_str(), launches[0].args.as_slice()), ("strided_copy_16", &expected[..]));
    assert_eq!(launches[0].grid, Grid { groups: 1, group_size: 16, what: "elements", grid_stride: true });

    // Each of these keeps the element copy: a row that is not whole units, an offset or a stride
    // off a unit, a transposed side, memory whose first byte is only 8-byte aligned.
    let cases = [
        (on_host(DType::BF16, &[3, 6], &[16, 1], 8, 48), vec![6, 1]),
        (on_host(DType::BF16, &[3, 8], &[16, 1], 2, 48), vec![8, 1]),
        (on_host(DType::BF16, &[3, 8], &[12, 1], 0, 48), vec![8, 1]),
        (on_host(DType::BF16, &[3, 8], &[1, 3], 0, 48), vec![8, 1]),
        (on_host_at(8, DType::BF16, &[3, 8], &[16, 1], 8, 48), vec![8, 1]),
    ];
    for (src, dst_strides) in cases {
        let mut dst = on_host(DType::BF16, src.shape(), &dst_strides, 0, 24);
        let layout = dst.layout().clone();
        copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &layout).unwrap();
        let symbols: Vec<String> = take_launches().into_iter().map(|l| l.symbol).collect();
        assert_eq!(symbols, ["strided_copy_2"], "{:?}", src.layout());
    }
}

#[test]
fn kernel_symbols_are_op_then_dtype() {
    assert_eq!(KernelKey::Rotary { dtype: DType::BF16 }.symbol(), "rotary_embedding_bf16");
    let op = GatedKernel { def: &ir_ops::silu_and_mul::SILU_AND_MUL, source: "" };
    assert_eq!(KernelKey::Gated { op: &op, dtype: DType::F16, vectorized: false }.symbol(), "silu_and_mul_f16");
    let vectorized = KernelKey::Gated { op: &op, dtype: DType::BF16, vectorized: true };
    assert_eq!(vectorized.symbol(), "silu_and_mul_bf16_vec");
}

#[test]
fn row_program_host_code_passes_the_generated_prototype() {
    use ir_ops::row_program::RowArg;
    // layer_norm with a weight: x is 3 rows of 8, 10 apart, from element 2; the weight 8 elements
    // from element 1 of its buffer.
    let x = on_host(DType::BF16, &[3, 8], &[10, 1], 2, 40);
    let w = on_host(DType::F32, &[8], &[1], 1, 9);
    let program = ir_ops::layer_norm::program(true, false);
    let out =
        run_row_program::<Recorder>(program, &[RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-5)]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].shape(), out[0].dtype()), ([3, 8].as_slice(), DType::BF16));
    assert!(out[0].layout().is_compact_at_zero());
    assert_eq!(
        take_launches(),
        [Launched {
            symbol: crate::program::ROW_PROGRAM_KERNEL.to_owned(),
            grid: Grid { groups: 1, group_size: 128, what: "rows", grid_stride: true }, // 8 threads per row: 16 rows to a block.
            args: [
                "I64(3)",
                "I32(8)",
                "read 80 bytes @2x2",
                "I64(10)",
                "I64(3)",
                "I64(0)",
                "read 36 bytes @1x4",
                "F64(1e-5)",
                "write 48 bytes @0x2"
            ]
            .map(str::to_owned)
            .to_vec(),
        }]
    );
    // No rows: outputs, no launch. A tensor in host memory, or a bad count, is an error naming it.
    let empty = on_host(DType::F32, &[0, 8], &[8, 1], 0, 0);
    let out = run_row_program::<Recorder>(program, &[RowArg::Tensor(&empty), RowArg::Tensor(&w), RowArg::Scalar(1e-5)])
        .unwrap();
    assert_eq!(out[0].shape(), [0, 8]);
    assert!(take_launches().is_empty());
    let host = Tensor::zeros(DType::F32, &[8]).unwrap();
    let error =
        run_row_program::<Recorder>(program, &[RowArg::Tensor(&x), RowArg::Tensor(&host), RowArg::Scalar(1e-5)])
            .unwrap_err();
    assert!(error.to_string().contains("weight"), "{error}");
    let variance = ir_ops::row_program::builtin::rms_norm(false, true);
    let x = on_host(DType::F32, &[2, 8], &[8, 1], 0, 16);
    for count in [0.0, 9.0, 2.5] {
        let error =
            run_row_program::<Recorder>(&variance, &[RowArg::Tensor(&x), RowArg::Scalar(1e-6), RowArg::Scalar(count)])
                .unwrap_err();
        assert!(error.to_string().contains(&format!("{count}")), "count {count}: {error}");
    }
    assert!(take_launches().is_empty());
}

#[test]
fn row_program_host_code_passes_donated_activations_as_the_in_place_prototype() {
    use ir_ops::row_program::{InPlaceArg, RowArg};
    let unique = |t: Tensor| UniqueTensor::new(t).unwrap_or_else(|_| panic!("a fresh tensor is uniquely owned"));
    // fused_add_layer_norm without weight or bias: x 2 rows of 8, 12 apart, from element 4; the
    // residual compact. Both donated: written through their own buffers, no output allocated.
    let program = ir_ops::fused_add_layer_norm::program(false, false, ir_ops::Rounding::Exact);
    let mut x = unique(on_host(DType::F16, &[2, 8], &[12, 1], 4, 24));
    let mut r = unique(on_host(DType::F16, &[2, 8], &[8, 1], 0, 16));
    let mut args = [InPlaceArg::Donated(&mut x), InPlaceArg::Donated(&mut r), InPlaceArg::Read(RowArg::Scalar(1e-5))];
    let out = crate::gpu::run_row_program_in_place::<Recorder>(program, &mut args).unwrap();
    assert!(out.iter().all(Option::is_none), "both outputs in place");
    assert_eq!(
        take_launches(),
        [Launched {
            symbol: crate::program::ROW_PROGRAM_KERNEL.to_owned(),
            grid: Grid { groups: 1, group_size: 128, what: "rows", grid_stride: true }, // 8 threads per row: 16 rows to a block.
            args: [
                "I64(2)",
                "I32(8)",
                "write 48 bytes @4x2",
                "I64(12)",
                "I64(2)",
                "I64(0)",
                "write 32 bytes @0x2",
                "I64(8)",
                "I64(2)",
                "I64(0)",
                "F64(1e-5)"
            ]
            .map(str::to_owned)
            .to_vec(),
        }]
    );
    // The generated prototype for that call: the activations writable, no output parameters.
    let read: Vec<RowArg<'_>> = [RowArg::Tensor(x.tensor()), RowArg::Tensor(r.tensor()), RowArg::Scalar(1e-5)].to_vec();
    let mut binding = program.bind(&read).unwrap();
    binding.in_place = true;
    let shape = crate::program::RowShape::for_call(program, &binding, false);
    let source = crate::program::gpu_source(program, &binding, shape).unwrap();
    assert!(!source.contains("out0") && !source.contains("out1"), "{source}");
    assert!(source.contains("(in0 + base0 + j0,") && source.contains("(in1 + base1 + j0,"), "{source}");
    // A donated activation the program does not write, or one it writes but not donated: refused
    // before anything runs.
    let norm = ir_ops::row_program::builtin::rms_norm(false, false);
    let mut args = [InPlaceArg::Donated(&mut x), InPlaceArg::Read(RowArg::Scalar(1e-5))];
    let error = crate::gpu::run_row_program_in_place::<Recorder>(&norm, &mut args).unwrap_err().to_string();
    assert!(error.contains("`x` is donated but no output is written in place of it"), "{error}");
    let residual = on_host(DType::F16, &[2, 8], &[8, 1], 0, 16);
    let mut args = [
        InPlaceArg::Donated(&mut x),
        InPlaceArg::Read(RowArg::Tensor(&residual)),
        InPlaceArg::Read(RowArg::Scalar(1e-5)),
    ];
    let error = crate::gpu::run_row_program_in_place::<Recorder>(program, &mut args).unwrap_err().to_string();
    assert!(error.contains("`x_residual` is written in place but not donated"), "{error}");
    assert!(take_launches().is_empty());
}
