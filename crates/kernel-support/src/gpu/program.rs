//! Row programs' host code: a call of any program ([`ir_ops::row_program`]) launched as the kernel
//! generated from it ([`crate::program::gpu_source`] on CUDA and HIP), which a backend compiles at
//! first use and caches per program and [`Signature`](crate::program::Signature).

use std::borrow::Cow;

use ir_core::op::ArgMeta;
use ir_core::storage::Storage;
use ir_core::{DeviceKind, KernelError, Layout, Registry, RegistryError, Support, Tensor};
use ir_ops::row_program::{InputKind, RowArg, RowProgram};

use super::{GpuBackend, GpuRuntime, Grid, KernelArgs, KernelKey};
use crate::program::{ROW_BLOCK, check_counts};
use crate::{KernelDTypes, Rows, device_buffer, kernel_int, stepped_extent};

/// Runs `program` on `args` on runtime `R`: its outputs as fresh compact tensors on the device of
/// the first activation, from one launch of the kernel generated for the call's dtypes (a group of
/// [`ROW_BLOCK`] per row). Every tensor argument must be `R`'s memory and rows of one stride with a
/// unit last stride (what [`row_program_support_with`] asks).
pub fn run_row_program<R: GpuRuntime>(program: &RowProgram, args: &[RowArg<'_>]) -> Result<Vec<Tensor>, KernelError> {
    let binding = program.bind(args)?;
    check_counts(program, args, &binding)?;
    let inputs = program.inputs();
    let first = inputs
        .iter()
        .position(|input| matches!(input.kind, InputKind::Activation { .. }))
        .expect("a built program has an activation");
    let RowArg::Tensor(first_tensor) = args[first] else { unreachable!("bind checks each argument's kind") };
    let like = device_buffer::<R::Buffer>(first_tensor, &inputs[first].name, R::MEMORY)?;
    let queue = R::queue(like)?;
    // Each tensor argument's buffer and rows, checked before anything is allocated.
    let mut buffers = Vec::with_capacity(args.len());
    for (input, arg) in inputs.iter().zip(args) {
        buffers.push(match arg {
            RowArg::Tensor(tensor) => {
                let buffer = device_buffer::<R::Buffer>(tensor, &input.name, R::MEMORY)?;
                if !R::same_device(buffer, like) {
                    return Err(KernelError::InvalidArguments {
                        reason: format!("`{}` is on another device than `{}`", input.name, inputs[first].name),
                    });
                }
                Some((buffer, Rows::for_kernel(tensor.meta())?))
            }
            RowArg::Scalar(_) => None,
        });
    }
    let steps = program.steps();
    let mut outputs = Vec::with_capacity(program.outputs().len());
    for output in program.outputs() {
        let shape = binding.output_shape(steps[output.value.0 as usize].extent);
        let dtype = binding.output_dtype(output.dtype);
        let layout = Layout::compact(&shape);
        let buffer = R::allocate(like, &queue, layout.storage_end() * dtype.size_in_bytes())?;
        outputs.push((buffer, dtype, layout));
    }
    if binding.rows > 0 {
        let kernel = R::kernel(like, KernelKey::RowProgram { program, binding: &binding })?;
        let mut launch: KernelArgs<'_, R::Buffer> = KernelArgs::new();
        launch.long(kernel_int(binding.rows, "rows")?).int(stepped_extent(binding.width, "row width", ROW_BLOCK)?);
        for ((input, arg), buffer) in inputs.iter().zip(args).zip(&buffers) {
            match (arg, buffer) {
                (RowArg::Scalar(value), _) => {
                    launch.scalar(super::Scalar::F64(*value));
                }
                (RowArg::Tensor(tensor), Some((buffer, rows))) => {
                    launch.read(*buffer, rows.offset, tensor.dtype());
                    if matches!(input.kind, InputKind::Activation { .. }) {
                        launch.long(kernel_int(rows.row_stride, "row stride")?);
                    }
                }
                (RowArg::Tensor(_), None) => unreachable!("every tensor's buffer was taken above"),
            }
        }
        for (buffer, dtype, _) in &mut outputs {
            launch.write(buffer, 0, *dtype);
        }
        let grid = Grid { groups: binding.rows, group_size: ROW_BLOCK, what: "rows", grid_stride: true };
        // SAFETY: the arguments follow the generated prototype (`gpu_source`): the row count and
        // width (converted without loss, the width with room for the kernel's last column step),
        // then per input its buffer at its first element and, for an activation, its row stride
        // (each converted without loss), a scalar as a double, then the outputs. The kernel reads
        // activation i at `row · row_stride + b · W + j` (row below its rows, b below its blocks,
        // j below W: inside its rows, which `bind` checked and whose layout was checked against
        // its storage), a weight at `j < W` (its `[W]` shape) and a scalar tensor at 0; it reads a
        // prefix of `count` elements only for counts `check_counts` accepted. It writes output k
        // at `row · W + j` or `row`, inside the fresh compact buffers allocated above for the
        // outputs' shapes, which only this launch holds; the inputs are only read.
        unsafe { R::launch(&queue, &kernel, grid, launch) }?;
    }
    outputs
        .into_iter()
        .map(|(buffer, dtype, layout)| Ok(Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, layout)?))
        .collect()
}

/// The predicate of an op a GPU backend runs as a generated kernel: the device computes in f64
/// (`dtypes` holds it: a generated kernel's row values are double), and every tensor argument is
/// on `device` in one of `dtypes`, rows of one stride with a unit last stride, with a last
/// dimension the kernels' 32-bit column index reaches.
pub fn row_program_support_with(args: &[ArgMeta<'_>], device: DeviceKind, dtypes: KernelDTypes) -> Support {
    if !dtypes.contains(ir_core::DType::F64) {
        return Support::No(Cow::Borrowed(
            "the device does not compute in f64, which a generated kernel's row values are (an OpenCL device without cl_khr_fp64)",
        ));
    }
    for (position, arg) in args.iter().enumerate() {
        let ArgMeta::Tensor(meta) = arg else { continue };
        let name = || format!("argument {position}");
        if !dtypes.contains(meta.dtype) {
            return Support::No(Cow::Owned(format!(
                "{} dtype {} is not one of {}",
                name(),
                meta.dtype,
                dtypes.describe()
            )));
        }
        if meta.device.kind() != device {
            return Support::No(Cow::Owned(format!(
                "{} is on {}, this provider runs on {device}",
                name(),
                meta.device
            )));
        }
        if i32::try_from(meta.layout.last_dim()).map_or(true, |w| w > i32::MAX - ROW_BLOCK as i32) {
            return Support::No(Cow::Owned(format!(
                "{}'s last dimension {} exceeds the generated kernels' 32-bit column index",
                name(),
                meta.layout.last_dim()
            )));
        }
        if let Err(reason) = Rows::of(meta) {
            return Support::No(Cow::Owned(format!("{}: {reason}", name())));
        }
    }
    Support::Yes
}

/// Registers runtime `R`'s implementations of the built-in ops defined by row programs
/// (`layer_norm`, `silu_and_mul_dynamic_fp8_quant`): each the kernel generated from its program for
/// the call's dtypes.
pub(crate) fn register_program_ops<R: GpuRuntime>(
    registry: &Registry,
    backend: GpuBackend,
) -> Result<(), RegistryError> {
    let GpuBackend { device, dtypes, spec, .. } = backend;
    let spec = move || spec().with_supports(move |args| row_program_support_with(args, device, dtypes()));
    ir_ops::layer_norm::register(registry, spec(), |x, weight, bias, epsilon| {
        ir_ops::layer_norm::run_with(run_row_program::<R>, x, weight, bias, epsilon)
    })?;
    ir_ops::silu_and_mul_dynamic_fp8_quant::register(registry, spec(), |x, scale_ub, out_dtype| {
        ir_ops::silu_and_mul_dynamic_fp8_quant::run_with(run_row_program::<R>, x, scale_ub, out_dtype)
    })
}
