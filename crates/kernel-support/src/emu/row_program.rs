//! Row programs on the emulated GPU: the kernel [`gpu_source`] generates, built as a dialect's
//! compiler gets it and launched on host tensors, without a backend's runtime (the tests of the
//! generator; the emulated providers launch generated kernels through their runtimes).

use ir_core::{KernelError, Tensor};
use ir_ops::row_program::{InputKind, RowArg, RowProgram};

use super::{Dialect, EmuArg, EmuGrid, EmuProgram};
use crate::program::{
    ChunkBuffer, ROW_PROGRAM_HEADERS, ROW_PROGRAM_KERNEL, RowShape, check_counts, chunks_aligned, gpu_source,
    read_in_chunks,
};

/// The generated kernel run on the emulated GPU: the program's outputs on `args`
/// (host tensors), as fresh compact tensors, from the source [`gpu_source`] generates compiled as
/// `dialect`'s compiler gets it (cached by the emulator under a hash of the source), in the shape
/// a GPU backend picks ([`RowShape::for_call`]: whole chunks where every buffer is aligned, unless
/// `scalar`).
pub fn run_row_program(
    program: &RowProgram,
    args: &[RowArg<'_>],
    dialect: Dialect,
    scalar: bool,
) -> Result<Vec<Tensor>, KernelError> {
    let invalid = |reason: String| KernelError::InvalidArguments { reason };
    let binding = program.bind(args)?;
    check_counts(program, args, &binding)?;
    // Host tensors whose last dimension is contiguous (strided ones copied).
    let mut held: Vec<Option<Tensor>> = Vec::with_capacity(args.len());
    for (input, arg) in program.inputs().iter().zip(args) {
        held.push(match arg {
            RowArg::Tensor(tensor) if tensor.cpu_buffer().is_none() => {
                return Err(KernelError::WrongMemory { param: input.name.clone(), memory: "host" });
            }
            RowArg::Tensor(tensor) if crate::RowBlocks::of_any(tensor.meta()).is_err() => Some(tensor.contiguous()?),
            _ => None,
        });
    }
    let to_i64 = |v: usize| i64::try_from(v).map_err(|_| crate::out_of_range("extent", v, 0, i64::MAX));
    let mut launch_args =
        vec![EmuArg::i64(to_i64(binding.rows)?), EmuArg::i32(crate::kernel_int(binding.width, "width")?)];
    for ((input, arg), copy) in program.inputs().iter().zip(args).zip(&held) {
        match arg {
            RowArg::Scalar(value) => launch_args.push(EmuArg::f64(*value)),
            RowArg::Tensor(tensor) => {
                let tensor = copy.as_ref().unwrap_or(tensor);
                let buffer = tensor.cpu_buffer().expect("checked above: host tensors");
                let blocks = crate::RowBlocks::of_any(tensor.meta())
                    .map_err(|reason| invalid(format!("`{}`: {reason}", input.name)))?;
                let rows = blocks.rows;
                let size = tensor.dtype().size_in_bytes();
                // At the tensor's first element (inside the buffer: its layout was checked against
                // its storage).
                launch_args.push(EmuArg::buffer(buffer.as_ptr().wrapping_add(rows.offset * size), size));
                match input.kind {
                    InputKind::Activation { .. } => launch_args.extend([
                        EmuArg::i64(to_i64(rows.row_stride)?),
                        EmuArg::i64(to_i64(rows.n_rows.max(1))?),
                        EmuArg::i64(to_i64(blocks.stride)?),
                    ]),
                    // `bind` checked that the positions split the rows evenly.
                    InputKind::Positions => {
                        launch_args.push(EmuArg::i64(to_i64(binding.rows / tensor.numel().max(1))?))
                    }
                    InputKind::CosSinCache { .. } => launch_args.extend([
                        EmuArg::i64(to_i64(rows.row_stride)?),
                        EmuArg::i32(crate::kernel_int(rows.hidden, "rotary width")?),
                        EmuArg::i64(to_i64(rows.n_rows)?),
                    ]),
                    _ => {}
                }
            }
        }
    }
    let mut outputs = Vec::with_capacity(program.outputs().len());
    for output in program.outputs() {
        let shape = binding.output_shape(program.steps()[output.value.0 as usize].extent);
        outputs.push(Tensor::zeros(binding.output_dtype(output.dtype), &shape)?);
    }
    // Whole chunks where every tensor's first element and strides keep a chunk aligned.
    let mut buffers = Vec::new();
    for ((input, arg), copy) in program.inputs().iter().zip(args).zip(&held) {
        let RowArg::Tensor(tensor) = arg else { continue };
        let tensor = copy.as_ref().unwrap_or(tensor);
        if !read_in_chunks(input) {
            continue;
        }
        let blocks = crate::RowBlocks::of_any(tensor.meta()).map_err(|reason| invalid(reason.to_string()))?;
        let size = tensor.dtype().size_in_bytes();
        let address = tensor.cpu_buffer().expect("checked above: host tensors").as_ptr() as usize;
        buffers.push(ChunkBuffer {
            dtype: tensor.dtype(),
            alignment: crate::gpu::address_alignment((address + blocks.rows.offset * size) as u64),
            strides: [blocks.rows.row_stride, blocks.stride],
        });
    }
    for output in &mut outputs {
        let address = output.cpu_buffer_mut()?.expect("a fresh host tensor").bytes_mut().as_ptr() as usize;
        let alignment = crate::gpu::address_alignment(address as u64);
        buffers.push(ChunkBuffer { dtype: output.dtype(), alignment, strides: [0, 0] });
    }
    let aligned = !scalar && chunks_aligned(program, &binding, buffers);
    let shape = RowShape::for_call(program, &binding, aligned);
    let source = gpu_source(program, &binding, shape)?;
    let defines = crate::program::shape_defines(shape);
    let built = EmuProgram::build(dialect, &defines, &format!("{ROW_PROGRAM_HEADERS}{source}"))
        .map_err(|error| KernelError::Driver { backend: "emulated gpu", message: error.to_string() })?;
    for output in &mut outputs {
        let size = output.dtype().size_in_bytes();
        let buffer = output.cpu_buffer_mut()?.expect("a fresh host tensor");
        launch_args.push(EmuArg::buffer(buffer.bytes_mut().as_mut_ptr(), size));
    }
    let groups = shape.groups(binding.rows);
    let blocks = match dialect {
        Dialect::Cuda => u32::try_from(groups).map_err(|_| invalid("too many rows".to_owned()))?,
        Dialect::Hip => u32::try_from(groups.min(1024)).unwrap_or(1024),
    };
    let warp = match dialect {
        Dialect::Cuda => 32,
        Dialect::Hip => 64,
    };
    // SAFETY: the kernel reads input i at `offset + (row / inner) · outer + (row % inner) ·
    // row_stride + b · width + j` (activations, b below its blocks, j below width, row below
    // n_rows: a row of one of its row blocks, `RowBlocks::of_any`), `offset + j` (weights), `offset`
    // (scalar tensors), `offset + row / per` (positions: below their count) and `offset + pos ·
    // row_stride + c` (a cache: only for a position below its row count, c below its width):
    // inside each tensor's rows, which its storage holds (`Rows` of a tensor's
    // layout, checked against its storage when the tensor was made). It writes output k at
    // `row · width + j` or `row`: inside the fresh compact outputs, which nothing else reads or
    // writes while it runs (the inputs are only read).
    unsafe { built.launch(ROW_PROGRAM_KERNEL, EmuGrid { blocks, threads: shape.block(), warp }, &launch_args) }
        .map_err(|error| KernelError::Driver { backend: "emulated gpu", message: error.to_string() })?;
    drop(held);
    Ok(outputs)
}

#[cfg(test)]
mod tests;
