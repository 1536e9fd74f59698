//! Row programs' host code: a call of any program ([`ir_ops::row_program`]) launched as the kernel
//! generated from it ([`crate::program::gpu_source`] on CUDA and HIP), which a backend compiles at
//! first use and caches per program and [`Signature`](crate::program::Signature).

use std::borrow::Cow;

use ir_core::op::ArgMeta;
use ir_core::storage::Storage;
use ir_core::{DeviceKind, KernelError, Layout, Registry, RegistryError, Support, Tensor};
use ir_ops::row_program::{InPlaceArg, InputKind, RowArg, RowProgram};

use super::{GpuBackend, GpuRuntime, Grid, KernelArgs, KernelKey};
use crate::program::{ChunkBuffer, ROW_BLOCK, RowShape, check_counts, chunks_aligned, read_in_chunks};
use crate::{KernelDTypes, device_buffer, kernel_int, stepped_extent};

/// Runs `program` on `args` on runtime `R`: its outputs as fresh compact tensors on the device of
/// the first activation, from one launch of the kernel generated for the call's dtypes (in the
/// [`RowShape`] of the call: the hand-written norms' threads per row, whole 16-byte chunks where
/// every buffer is aligned). Every tensor argument must be `R`'s memory and rows of one stride with a
/// unit last stride (what [`row_program_support_with`] asks).
pub fn run_row_program<R: GpuRuntime>(program: &RowProgram, args: &[RowArg<'_>]) -> Result<Vec<Tensor>, KernelError> {
    let mut args: Vec<InPlaceArg<'_>> = args.iter().map(|arg| InPlaceArg::Read(*arg)).collect();
    let outputs = launch::<R>(program, &mut args)?;
    Ok(outputs.into_iter().map(|output| output.expect("nothing is donated: every output is fresh")).collect())
}

/// [`run_row_program`] with the program's in-place outputs written into the donated activations
/// (the kernel generated for the call in place: each thread writes the columns of a row it has
/// read, in the pass that reads them last); returns the outputs in order, `None` for those
/// written in place. Every activation an output is stored in place of must be donated, in the
/// output's dtype.
pub fn run_row_program_in_place<R: GpuRuntime>(
    program: &RowProgram,
    args: &mut [InPlaceArg<'_>],
) -> Result<Vec<Option<Tensor>>, KernelError> {
    launch::<R>(program, args)
}

/// One launch of `program`'s kernel on `args`, in place when an argument is donated.
fn launch<R: GpuRuntime>(
    program: &RowProgram,
    args: &mut [InPlaceArg<'_>],
) -> Result<Vec<Option<Tensor>>, KernelError> {
    let inputs = program.inputs();
    let refuse = |reason: String| KernelError::InvalidArguments {
        reason: format!("row program `{}` cannot run in place: {reason}", program.name()),
    };
    let first = inputs
        .iter()
        .position(|input| matches!(input.kind, InputKind::Activation { .. }))
        .expect("a built program has an activation");
    // Everything that reads the arguments, before a donated storage is borrowed for writing: the
    // binding, each tensor's rows, the queue, the kernel and the fresh outputs.
    let (binding, rows, queue, kernel, mut outputs, shape) = {
        let read: Vec<RowArg<'_>> = args.iter().map(InPlaceArg::as_read).collect();
        let mut binding = program.bind(&read)?;
        check_counts(program, &read, &binding)?;
        binding.in_place = args.iter().any(|arg| matches!(arg, InPlaceArg::Donated(_)));
        for (index, arg) in args.iter().enumerate() {
            let name = &inputs[index].name;
            let output = program.outputs().iter().find(|o| o.in_place_of == Some(index));
            match (arg, output) {
                (InPlaceArg::Donated(_), None) => {
                    return Err(refuse(format!("`{name}` is donated but no output is written in place of it")));
                }
                (InPlaceArg::Read(_), Some(_)) if binding.in_place => {
                    return Err(refuse(format!("`{name}` is written in place but not donated")));
                }
                (InPlaceArg::Donated(tensor), Some(output)) => {
                    let dtype = binding.output_dtype(output.dtype);
                    if dtype != tensor.tensor().dtype() {
                        return Err(refuse(format!(
                            "`{name}` is {} but its output is {dtype}",
                            tensor.tensor().dtype()
                        )));
                    }
                }
                _ => {}
            }
        }
        let RowArg::Tensor(first_tensor) = read[first] else { unreachable!("bind checks each argument's kind") };
        let like = device_buffer::<R::Buffer>(first_tensor, &inputs[first].name, R::MEMORY)?;
        let queue = R::queue(like)?;
        // Each tensor argument's rows, its buffer checked before anything is allocated.
        let mut rows = Vec::with_capacity(read.len());
        for (input, arg) in inputs.iter().zip(&read) {
            rows.push(match arg {
                RowArg::Tensor(tensor) => {
                    let buffer = device_buffer::<R::Buffer>(tensor, &input.name, R::MEMORY)?;
                    if !R::same_device(buffer, like) {
                        return Err(KernelError::InvalidArguments {
                            reason: format!("`{}` is on another device than `{}`", input.name, inputs[first].name),
                        });
                    }
                    Some(crate::RowBlocks::of_any(tensor.meta()).map_err(|reason| KernelError::InvalidArguments {
                        reason: format!("`{}`: {reason}", input.name),
                    })?)
                }
                RowArg::Scalar(_) => None,
            });
        }
        let steps = program.steps();
        let mut outputs = Vec::with_capacity(program.outputs().len());
        for output in program.outputs() {
            if binding.in_place && output.in_place_of.is_some() {
                outputs.push(None);
                continue;
            }
            let shape = binding.output_shape(steps[output.value.0 as usize].extent);
            let dtype = binding.output_dtype(output.dtype);
            let layout = Layout::compact(&shape);
            let buffer = R::allocate(like, &queue, layout.storage_end() * dtype.size_in_bytes())?;
            outputs.push(Some((buffer, dtype, layout)));
        }
        // Whole chunks where the width splits into them and every activation, weight and fresh
        // output keeps a chunk aligned at each row and block.
        let mut buffers = Vec::new();
        for ((input, arg), rows) in inputs.iter().zip(&read).zip(&rows) {
            let (RowArg::Tensor(tensor), Some(blocks)) = (arg, rows) else { continue };
            if !read_in_chunks(input) {
                continue;
            }
            let buffer = device_buffer::<R::Buffer>(tensor, &input.name, R::MEMORY)?;
            let offset_bytes = blocks.rows.offset * tensor.dtype().size_in_bytes();
            let alignment = match R::base_alignment(buffer) {
                0 => 0,
                base => base.min(super::address_alignment(offset_bytes as u64)),
            };
            buffers.push(ChunkBuffer {
                dtype: tensor.dtype(),
                alignment,
                strides: [blocks.rows.row_stride, blocks.stride],
            });
        }
        for (buffer, dtype, _) in outputs.iter().flatten() {
            buffers.push(ChunkBuffer { dtype: *dtype, alignment: R::base_alignment(buffer), strides: [0, 0] });
        }
        let aligned = chunks_aligned(program, &binding, buffers);
        let shape = if R::GENERATED_CHUNKS { RowShape::for_call(program, &binding, aligned) } else { RowShape::Walk };
        let kernel = if binding.rows > 0 {
            Some(R::kernel(like, KernelKey::RowProgram { program, binding: &binding, shape })?)
        } else {
            None
        };
        (binding, rows, queue, kernel, outputs, shape)
    };
    if let Some(kernel) = kernel {
        let mut launch: KernelArgs<'_, R::Buffer> = KernelArgs::new();
        launch.long(kernel_int(binding.rows, "rows")?).int(stepped_extent(binding.width, "row width", ROW_BLOCK)?);
        for ((input, arg), rows) in inputs.iter().zip(args.iter_mut()).zip(&rows) {
            match (arg, rows) {
                (InPlaceArg::Read(RowArg::Scalar(value)), _) => {
                    launch.scalar(super::Scalar::F64(*value));
                }
                (InPlaceArg::Read(RowArg::Tensor(tensor)), Some(rows)) => {
                    let tensor: &Tensor = tensor;
                    launch.read(
                        device_buffer::<R::Buffer>(tensor, &input.name, R::MEMORY)?,
                        rows.rows.offset,
                        tensor.dtype(),
                    );
                    let rows_of_blocks = *rows;
                    let rows = rows.rows;
                    match input.kind {
                        InputKind::Activation { .. } => block_args(&mut launch, rows_of_blocks)?,
                        // Rows per position (`bind` checked that they split the rows evenly).
                        InputKind::Positions => {
                            launch.long(kernel_int(binding.rows / tensor.numel().max(1), "rows per position")?);
                        }
                        InputKind::CosSinCache { .. } => {
                            launch
                                .long(kernel_int(rows.row_stride, "cache row stride")?)
                                .int(stepped_extent(rows.hidden, "rotary width", 1)?)
                                .long(kernel_int(rows.n_rows, "cache positions")?);
                        }
                        _ => {}
                    }
                }
                (InPlaceArg::Donated(tensor), Some(rows)) => {
                    let dtype = tensor.tensor().dtype();
                    launch.write(
                        crate::device_buffer_mut::<R::Buffer>(tensor, &input.name, R::MEMORY)?,
                        rows.rows.offset,
                        dtype,
                    );
                    block_args(&mut launch, *rows)?;
                }
                (_, None) => unreachable!("every tensor's rows were taken above"),
            }
        }
        for (buffer, dtype, _) in outputs.iter_mut().flatten() {
            launch.write(buffer, 0, *dtype);
        }
        let grid =
            Grid { groups: shape.groups(binding.rows), group_size: shape.block(), what: "rows", grid_stride: true };
        // SAFETY: the arguments follow the generated prototype (`gpu_source` for `shape`, in place
        // when `binding.in_place`; its grid covers the rows in `shape`'s groups, a thread past the
        // last row loads no chunk and writes nothing, and whole-chunk accesses only
        // where `chunks_aligned` allowed them): the row count and width (converted without loss, the width with room
        // for the kernel's last column step), then per input its buffer at its first element and,
        // for an activation, its row stride, rows per block and block stride, for positions the rows per position, for a cache its
        // row stride, width and row count (each converted without loss), a scalar as a double,
        // then the fresh outputs. The kernel reads activation i at `(row / inner) · outer + (row % inner)
        // · row_stride + b · W + j` (row below its rows, b below its blocks, j below W: inside its
        // rows, one of its row blocks' rows (`RowBlocks::of_any` of its layout, which `bind` checked
        // and which was checked against its storage)), a weight at `j < W` (its `[W]` shape)
        // and a scalar tensor at 0; positions at `row / per` (below their count: `bind` checked
        // that they split the rows evenly, unit stride: the predicate), a cache at
        // `pos · stride + c` only for a position below its row count and a column `c` below its
        // width R (pair `p < R/2`, at `p` and `R/2 + p`); it reads a prefix of `count` elements only
        // for counts `check_counts` accepted. It writes a fresh output k at `row · W + j` or `row`, inside the
        // compact buffers allocated above for the outputs' shapes, which only this launch holds,
        // and an in-place output at the elements of its donated activation it reads (one block,
        // its dtype, checked above), whose storage the `UniqueTensor` owns alone; read arguments
        // are only read, and none of them shares a donated storage (a unique one).
        unsafe { R::launch(&queue, &kernel, grid, launch) }?;
    }
    outputs
        .into_iter()
        .map(|output| {
            output
                .map(|(buffer, dtype, layout)| {
                    Ok(Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, layout)?)
                })
                .transpose()
        })
        .collect()
}

/// An activation's row arguments: the row stride, the rows per block and the block stride (rows
/// of one stride are one block).
fn block_args<B>(launch: &mut KernelArgs<'_, B>, rows: crate::RowBlocks) -> Result<(), KernelError> {
    launch
        .long(kernel_int(rows.rows.row_stride, "row stride")?)
        .long(kernel_int(rows.rows.n_rows.max(1), "rows per block")?)
        .long(kernel_int(rows.stride, "block stride")?);
    Ok(())
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
        // Positions are i64; `bind` refuses i64 anywhere else.
        if !dtypes.contains(meta.dtype) && meta.dtype != ir_core::DType::I64 {
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
        if let Err(reason) = crate::RowBlocks::of_any(meta) {
            return Support::No(Cow::Owned(format!("{}: {reason}", name())));
        }
    }
    Support::Yes
}

/// Registers runtime `R`'s implementations of the built-in ops defined by row programs
/// (`layer_norm`, `silu_and_mul_dynamic_fp8_quant`, and in place `fused_add_layer_norm`,
/// `fused_sandwich_rms_norm` and `fused_qk_norm_rope`): each the kernel generated from its program
/// for the call's dtypes.
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
    })?;
    use ir_ops::{fused_add_layer_norm as add_ln, fused_sandwich_rms_norm as sandwich};
    add_ln::register(
        registry,
        spec(),
        add_ln::Impl::inplace(|x, r, weight, bias, epsilon, rounding| {
            add_ln::run_in_place(run_row_program_in_place::<R>, x, r, weight, bias, epsilon, rounding)
        }),
    )?;
    sandwich::register(
        registry,
        spec(),
        sandwich::Impl::inplace(|x, r, post, pre, epsilon, rounding| {
            sandwich::run_in_place(run_row_program_in_place::<R>, x, r, post, pre, epsilon, rounding)
        }),
    )?;
    use ir_ops::fused_qk_norm_rope as qk;
    // The generated kernel walks the heads as rows: their views must be rows of one stride.
    let qk_spec = spec().with_supports(move |args| match row_program_support_with(args, device, dtypes()) {
        Support::Yes => crate::qk_norm_rope_support_with(args, device, dtypes(), true),
        refused => refused,
    });
    qk::register(
        registry,
        qk_spec,
        qk::Impl::inplace(
            |positions, q, k, q_weight, k_weight, cache, epsilon, head_size, _rotary_dim, neox, rounding| {
                let run = run_row_program_in_place::<R>;
                qk::run_in_place(run, positions, q, k, q_weight, k_weight, cache, epsilon, head_size, neox, rounding)
            },
        ),
    )
}
