//! Row programs on the cpu: a block-vectorized interpreter, which runs any program (a built-in
//! op's, or one a pass makes at run time) with no code generated for it.
//!
//! A row runs in passes: a program with `k` row reductions that depend on each other in a chain
//! needs `k + 1`. Each pass walks the row 1024 elements at a time (`CHUNK`) and runs, for each
//! chunk, only the element steps the pass needs (the operands of the reductions it accumulates; in
//! the last pass, of the outputs), each step one loop over the chunk's f32 values that the compiler
//! vectorizes (in the AVX2 or AVX-512 build the CPU has). An element value a later pass needs again
//! is computed again from the loads (a row is read once per pass, from the L1 or L2 cache) when that
//! is cheap; when its computation costs four element loops or more (a transcendental step, `exp`,
//! `tanh`, `erf`, `erfc`, `sigmoid`, counting as that many), the pass that first computes it keeps
//! its row in a buffer of the task, and later passes read it back instead (the same f32 values, so
//! the same bits; a fused gated activation + quantization computes its activation once, the
//! sandwich norm its residual sum). Row values (parameters, reductions and
//! what is computed from them) are `f64`, rounded as the program says, so the row arithmetic is the
//! reference's. Rows are split across threads as the norms' rows are.
//!
//! Element values are f32 (the compute type of f32, f16 and bf16 activations): a `compute` step is
//! then exactly the reference's, and a `wide` element step (a transcendental function the
//! reference composes in `f64`) is computed in f32, within the op's tolerance of the reference.
//! Sums of squares reduce in the order every cpu norm shares: 32 f32 lanes over the row's full
//! 32-element groups, a fixed tree, then the tail; sums likewise in f64 lanes (as the gated ops'
//! row statistics: a mean far from zero keeps its bits). A row whose sum is not finite is run
//! again with its sums
//! accumulated in `f64` in column order (the reference's order), as the norms do when their f32 sum
//! of squares overflows. So a norm program gives the cpu norm kernels' bits. `max_abs` does not
//! depend on the order. f64 activations are refused: their programs run on the reference
//! interpreter ([`RowProgram::run`]).
//!
//! A program that pairs columns (a rotation, [`Op::Pair`]) walks each row in one chunk (the row's
//! width rounded up to 32 lanes, at least 1024), so a column's partner is in the chunk its pair
//! reads. Positions outside a cos/sin cache are refused, naming the first.

use ir_core::{DType, KernelError, Tensor};
use ir_ops::row_program::{
    BinaryOp, Binding, Extent, InPlaceArg, InputKind, Op, Precision, ReduceOp, RowArg, RowProgram, Schedule, UnaryOp,
    ValueId,
};
use kernel_support::Rows;
use rayon::prelude::*;

use crate::element::CpuElement;
use crate::quant::{E4M3, E5M2, Fp8};
use crate::rows::{LANES, rows_per_task};
use ir_core::{F8E4M3, F8E5M2};

/// The unary steps whose element loops cost more than keeping their values: a value whose
/// computation holds one is kept for a later pass that needs it.
const TRANSCENDENTAL: [UnaryOp; 5] = [UnaryOp::Exp, UnaryOp::Tanh, UnaryOp::Erf, UnaryOp::Erfc, UnaryOp::Sigmoid];

/// The cost (element loops, loads counted) from which a value a later pass needs is kept in a row
/// buffer rather than computed again: keeping costs a copy out and a copy back, about two loops
/// (of 3, 4 and 6, 4 ran the sandwich norm and add + LayerNorm programs fastest).
const KEEP_COST: u32 = 4;

/// Elements computed at a time per step (a multiple of [`LANES`], so every chunk but a row's last
/// holds whole 32-element groups). 1024 rather than 256: a step's dispatch is paid once per 1024
/// elements.
const CHUNK: usize = 1024;

/// Runs `program` on `args` (as [`RowProgram::run`] takes them) on the cpu and returns its
/// outputs as fresh compact tensors, in order (an in-place output too: nothing is written in
/// place; [`run_row_program_in_place`] writes them). Fails naming the argument when the arguments
/// do not fit the program ([`RowProgram::bind`]), a tensor is not in host memory, an activation is
/// f64, or a reduction's count is not an integer in `1..=W`.
pub fn run_row_program(program: &RowProgram, args: &[RowArg<'_>]) -> Result<Vec<Tensor>, KernelError> {
    let binding = bind_f32(program, args)?;
    // Each tensor input as rows over its buffer (a compact copy when its last dimension is strided).
    let copies = compact_copies(program, args.iter().map(Some))?;
    let mut sources = Vec::with_capacity(args.len());
    for ((input, arg), copy) in program.inputs().iter().zip(args).zip(&copies) {
        sources.push(read_source(&input.name, &input.kind, arg, copy.as_ref())?);
    }
    check_positions(program, &sources)?;
    let sinks = fresh_sinks(program, &binding, &[])?;
    let outputs = execute(program, &binding, &sources, sinks)?;
    Ok(outputs.into_iter().map(|output| output.expect("every output is fresh")).collect())
}

/// Runs `program` on `args` on the cpu, writing each in-place output into its donated activation
/// (no copy, nothing allocated for it); returns the outputs in order, `None` for those written in
/// place. Each row is written in the pass that last reads it, chunk by chunk after the chunk is
/// read, so the written values are those [`run_row_program`] returns. Fails as
/// [`run_row_program`] does, and when a donated argument is not rows of one stride in host memory,
/// has no in-place output in the program, or the program's last pass finishes a sum (a row whose
/// sum overflows f32 is run again, which must not follow its writes).
pub fn run_row_program_in_place(
    program: &RowProgram,
    args: &mut [InPlaceArg<'_>],
) -> Result<Vec<Option<Tensor>>, KernelError> {
    let refuse = |reason: String| KernelError::InvalidArguments {
        reason: format!("row program `{}` cannot run in place: {reason}", program.name()),
    };
    let plan = program.schedule();
    let steps = program.steps();
    let last_sums = plan
        .reductions
        .last()
        .into_iter()
        .flatten()
        .any(|&index| !matches!(steps[index].op, Op::Reduce { op: ReduceOp::MaxAbs, .. }));
    if last_sums {
        return Err(refuse("its last pass finishes a sum, and a row is run again when its sum overflows".into()));
    }
    // Bound, and each donated argument's rows, before any storage is taken.
    let (binding, donated) = {
        let read: Vec<RowArg<'_>> = args.iter().map(InPlaceArg::as_read).collect();
        let mut binding = bind_f32(program, &read)?;
        binding.in_place = true;
        let mut donated = Vec::new();
        for (input, arg) in args.iter().enumerate() {
            let InPlaceArg::Donated(tensor) = arg else { continue };
            let name = &program.inputs()[input].name;
            let output = program.outputs().iter().position(|o| o.in_place_of == Some(input));
            let output =
                output.ok_or_else(|| refuse(format!("`{name}` is donated but no output is written in place of it")))?;
            let rows = Rows::of(tensor.tensor().meta()).map_err(|why| refuse(format!("`{name}`: {why}")))?;
            if tensor.tensor().cpu_buffer().is_none() {
                return Err(crate::not_on_cpu(name));
            }
            let dtype = binding.output_dtype(program.outputs()[output].dtype);
            if dtype != tensor.tensor().dtype() {
                return Err(refuse(format!("`{name}` is {} but its output is {dtype}", tensor.tensor().dtype())));
            }
            donated.push((input, output, rows));
        }
        (binding, donated)
    };
    let read: Vec<Option<RowArg<'_>>> =
        args.iter().map(|arg| if let InPlaceArg::Read(arg) = arg { Some(*arg) } else { None }).collect();
    let copies = compact_copies(program, read.iter().map(Option::as_ref))?;
    let mut sources = Vec::with_capacity(read.len());
    for (index, ((input, arg), copy)) in program.inputs().iter().zip(&read).zip(&copies).enumerate() {
        sources.push(match arg {
            Some(arg) => read_source(&input.name, &input.kind, arg, copy.as_ref())?,
            None => {
                let &(_, output, rows) =
                    donated.iter().find(|d| d.0 == index).expect("each donated argument is listed");
                Source::InPlace { output, rows, dtype: binding.output_dtype(program.outputs()[output].dtype) }
            }
        });
    }
    check_positions(program, &sources)?;
    // The donated storages, each from its first row's first element.
    let mut written: Vec<(usize, &mut [u8], Rows)> = Vec::with_capacity(donated.len());
    for (input, arg) in args.iter_mut().enumerate() {
        let InPlaceArg::Donated(tensor) = arg else { continue };
        let &(_, output, rows) = donated.iter().find(|d| d.0 == input).expect("each donated argument is listed");
        let size = tensor.tensor().dtype().size_in_bytes();
        let ir_core::storage::Storage::Cpu(buffer) = tensor.storage_mut()? else {
            return Err(crate::not_on_cpu(&program.inputs()[input].name));
        };
        let bytes = buffer.bytes_mut();
        let start = (rows.offset * size).min(bytes.len());
        written.push((output, &mut bytes[start..], rows));
    }
    let sinks = fresh_sinks(program, &binding, &written.iter().map(|w| w.0).collect::<Vec<_>>())?;
    let mut sinks: Vec<Sink<'_>> = sinks;
    for (output, bytes, rows) in written {
        sinks[output] = Sink::InPlace(bytes, rows);
    }
    execute(program, &binding, &sources, sinks)
}

/// The program bound to `args`, refused unless it computes in f32.
fn bind_f32(program: &RowProgram, args: &[RowArg<'_>]) -> Result<Binding, KernelError> {
    let binding = program.bind(args)?;
    if binding.compute != DType::F32 {
        return Err(KernelError::InvalidArguments {
            reason: format!(
                "row program `{}`: the cpu computes in f32; a program on f64 activations runs on the reference interpreter",
                program.name()
            ),
        });
    }
    Ok(binding)
}

/// A compact copy of each read tensor argument whose last dimension is strided (`None` for the
/// others; `args` gives `None` for a donated one).
fn compact_copies<'a>(
    program: &RowProgram,
    args: impl Iterator<Item = Option<&'a RowArg<'a>>>,
) -> Result<Vec<Option<Tensor>>, KernelError> {
    let mut copies = Vec::with_capacity(program.inputs().len());
    for (input, arg) in program.inputs().iter().zip(args) {
        copies.push(match arg {
            Some(RowArg::Tensor(tensor)) if tensor.cpu_buffer().is_none() => {
                return Err(crate::not_on_cpu(&input.name));
            }
            Some(RowArg::Tensor(_)) if input.kind == InputKind::Positions => None,
            Some(RowArg::Tensor(tensor)) if Rows::of(tensor.meta()).is_err() => Some(tensor.contiguous()?),
            _ => None,
        });
    }
    Ok(copies)
}

/// A read argument as a source: its rows over its buffer (or over `copy`), or its scalar value.
fn read_source<'a>(
    name: &str,
    kind: &InputKind,
    arg: &RowArg<'a>,
    copy: Option<&'a Tensor>,
) -> Result<Source<'a>, KernelError> {
    Ok(match arg {
        RowArg::Scalar(value) => Source::Scalar(*value),
        RowArg::Tensor(tensor) => {
            let tensor = copy.unwrap_or(tensor);
            let buffer = tensor.cpu_buffer().ok_or_else(|| crate::not_on_cpu(name))?;
            match kind {
                InputKind::ScalarTensor => Source::Scalar(tensor.to_f64_vec()?[0]),
                InputKind::Positions => Source::Positions(tensor.contiguous()?.to_vec::<i64>()?),
                _ => Source::Rows(buffer.bytes(), Rows::for_kernel(tensor.meta())?, tensor.dtype()),
            }
        }
    })
}

/// Refuses a position outside a cos/sin cache read at it, naming the first.
fn check_positions(program: &RowProgram, sources: &[Source<'_>]) -> Result<(), KernelError> {
    for (input, source) in program.inputs().iter().zip(sources) {
        let (InputKind::CosSinCache { positions, .. }, Source::Rows(_, rows, _)) = (&input.kind, source) else {
            continue;
        };
        let Source::Positions(at) = &sources[*positions] else { unreachable!("bind checked the positions") };
        let outside = |&p: &i64| usize::try_from(p).map_or(true, |p| p >= rows.n_rows);
        if let Some(group) = at.iter().position(outside) {
            return Err(KernelError::InvalidArguments {
                reason: format!(
                    "row program `{}`: position {} of row group {group} is outside the cos/sin cache `{}` (0..{})",
                    program.name(),
                    at[group],
                    input.name,
                    rows.n_rows
                ),
            });
        }
    }
    Ok(())
}

/// A fresh compact output for each of `program`'s outputs but those in `skip` (written in place;
/// a placeholder the caller replaces).
fn fresh_sinks<'a>(program: &RowProgram, binding: &Binding, skip: &[usize]) -> Result<Vec<Sink<'a>>, KernelError> {
    let mut sinks = Vec::with_capacity(program.outputs().len());
    for (index, output) in program.outputs().iter().enumerate() {
        if skip.contains(&index) {
            sinks.push(Sink::InPlace(&mut [], Rows { n_rows: 0, hidden: 0, row_stride: 0, offset: 0 }));
            continue;
        }
        let extent = program.steps()[output.value.0 as usize].extent;
        // Every element is written: no zero fill.
        let layout = ir_core::Layout::compact(&binding.output_shape(extent));
        sinks.push(Sink::Fresh(Tensor::empty_with_layout(binding.output_dtype(output.dtype), layout)?));
    }
    Ok(sinks)
}

/// Where an output is written: a fresh compact tensor, or a donated activation's storage from its
/// first row's first element (its rows).
enum Sink<'a> {
    Fresh(Tensor),
    InPlace(&'a mut [u8], Rows),
}

/// Runs the bound program over every row, writing `sinks`; returns the fresh outputs (`None` for
/// those written in place).
fn execute(
    program: &RowProgram,
    binding: &Binding,
    sources: &[Source<'_>],
    mut sinks: Vec<Sink<'_>>,
) -> Result<Vec<Option<Tensor>>, KernelError> {
    let plan = program.schedule();
    let exact = program.exact_in_f32(binding);
    let reuse = Reuse::plan(program, &plan);
    // Elements from one row's start to the next in each output's sink.
    let strides: Vec<usize> = program
        .outputs()
        .iter()
        .zip(&sinks)
        .map(|(output, sink)| match (sink, program.steps()[output.value.0 as usize].extent) {
            (Sink::InPlace(_, rows), _) => rows.row_stride,
            (Sink::Fresh(_), Extent::Element) => binding.width,
            (Sink::Fresh(_), Extent::Row) => 1,
        })
        .collect();
    // A program that pairs columns runs each row in one chunk, its partner columns in it.
    let chunk = match program.rotary_cache() {
        Some(_) => binding.width.next_multiple_of(LANES).max(CHUNK),
        None => CHUNK,
    };
    let run = Run { program, plan: &plan, reuse, exact, binding, sources, strides, chunk };
    let per_task = rows_per_task(binding.width, size_of::<f32>());
    // Each output's bytes, split into the tasks' disjoint row ranges (one piece per task and
    // output, empty where the output has no bytes; a donated activation's piece runs to the next
    // task's first row, or to the end of its storage).
    let n_tasks = binding.rows.div_ceil(per_task).max(1);
    let mut tasks: Vec<Vec<&mut [u8]>> = (0..n_tasks).map(|_| Vec::with_capacity(sinks.len())).collect();
    for ((output, sink), stride) in program.outputs().iter().zip(&mut sinks).zip(&run.strides) {
        let size = binding.output_dtype(output.dtype).size_in_bytes();
        let mut rest: &mut [u8] = match sink {
            Sink::Fresh(tensor) => tensor.cpu_buffer_mut()?.expect("a fresh host tensor").bytes_mut(),
            Sink::InPlace(bytes, _) => bytes,
        };
        for pieces in tasks.iter_mut() {
            let bytes = per_task.saturating_mul(*stride).saturating_mul(size).min(rest.len());
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(bytes);
            pieces.push(piece);
            rest = tail;
        }
    }
    let task_rows = |task: usize| task * per_task..((task + 1) * per_task).min(binding.rows);
    if tasks.len() <= 1 {
        let mut pieces = tasks.pop().unwrap_or_default();
        run.rows(0..binding.rows, &mut pieces)?;
    } else {
        tasks.into_par_iter().enumerate().try_for_each(|(task, mut pieces)| run.rows(task_rows(task), &mut pieces))?;
    }
    Ok(sinks
        .into_iter()
        .map(|sink| match sink {
            Sink::Fresh(tensor) => Some(tensor),
            Sink::InPlace(..) => None,
        })
        .collect())
}

/// Registers the cpu implementations of the built-in ops defined by row programs: `layer_norm`
/// and `silu_and_mul_dynamic_fp8_quant` functional, `fused_add_layer_norm` in place
/// ([`run_row_program_in_place`]), each its program run here; and `fused_sandwich_rms_norm` in
/// place as the cpu norm rows composed (`fused_sandwich_rms_norm_cpu`, its program's bits), and
/// `fused_qk_norm_rope` in place as the cpu `rms_norm` and rotary rows composed
/// (`fused_qk_norm_rope_cpu`); for f32, f16 and bf16 x in host memory (f64 runs on native, the same
/// program on the reference interpreter).
pub(crate) fn register_program_ops(registry: &ir_core::Registry) -> Result<(), ir_core::RegistryError> {
    use ir_core::op::ArgMeta;
    use ir_core::{Device, ImplSpec, Support};
    fn host_support(args: &[ArgMeta<'_>]) -> Support {
        for arg in args {
            if let ArgMeta::Tensor(meta) = arg
                && meta.device != Device::Cpu
            {
                return Support::No("a tensor is not in host memory".into());
            }
        }
        match args.first() {
            Some(ArgMeta::Tensor(x)) if matches!(x.dtype, DType::F32 | DType::F16 | DType::BF16) => Support::Yes,
            _ => Support::No("x is not f32, f16 or bf16".into()),
        }
    }
    let spec = || ImplSpec::new(crate::PROVIDER).with_supports(host_support);
    ir_ops::layer_norm::register(registry, spec(), |x, weight, bias, epsilon| {
        ir_ops::layer_norm::run_with(run_row_program, x, weight, bias, epsilon)
    })?;
    // Rows of one stride: the cpu silu_and_mul and quantization rows composed (the program's bits,
    // tested, at the hand-written rows' speed); other layouts: the program.
    ir_ops::silu_and_mul_dynamic_fp8_quant::register(registry, spec(), |x, scale_ub, out_dtype| {
        if Rows::of(x.meta()).is_ok() {
            crate::quant::silu_and_mul_dynamic_fp8_quant_cpu(x, scale_ub, out_dtype)
        } else {
            ir_ops::silu_and_mul_dynamic_fp8_quant::run_with(run_row_program, x, scale_ub, out_dtype)
        }
    })?;
    // The fused-add norms run in place: out into x, residual_out into the residual, which must
    // then be rows of one stride.
    let inplace_spec = || {
        ImplSpec::new(crate::PROVIDER).with_supports(|args: &[ArgMeta<'_>]| {
            if let Support::No(reason) = host_support(args) {
                return Support::No(reason);
            }
            for (arg, name) in args.iter().zip(["x", "x_residual"]) {
                if let ArgMeta::Tensor(meta) = arg
                    && let Err(reason) = Rows::of(meta)
                {
                    return Support::No(format!("{name}: {reason}").into());
                }
            }
            Support::Yes
        })
    };
    use ir_ops::{fused_add_layer_norm as add_ln, fused_sandwich_rms_norm as sandwich};
    add_ln::register(
        registry,
        inplace_spec(),
        add_ln::Impl::inplace(|x, r, weight, bias, epsilon, rounding| {
            add_ln::run_in_place(run_row_program_in_place, x, r, weight, bias, epsilon, rounding)
        }),
    )?;
    sandwich::register(
        registry,
        inplace_spec(),
        // The cpu norm rows composed: the program's bits (tested), at the hand-written rows' speed.
        sandwich::Impl::inplace(crate::fused_sandwich_rms_norm_cpu),
    )?;
    // The cpu `rms_norm` and rotary rows composed per token (column slices of qkv included).
    use ir_ops::fused_qk_norm_rope as qk;
    let qk_spec = ImplSpec::new(crate::PROVIDER).with_supports(|args: &[ArgMeta<'_>]| {
        kernel_support::qk_norm_rope_support_with(
            args,
            ir_core::DeviceKind::Cpu,
            kernel_support::KernelDTypes::Reduced,
            false,
        )
    });
    qk::register(registry, qk_spec, qk::Impl::inplace(crate::rotary::fused_qk_norm_rope_cpu))
}

/// The rows of a task ([`Run::rows`] gives it the scratch and the row state), compiled for
/// AVX-512, AVX2 and NEON besides the baseline and chosen at run time (every step loop is inlined
/// into it, so each is vectorized for the CPU it runs on); the same bits on every path (Rust never
/// contracts a multiply and an add by itself).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn run_rows(
    run: &Run<'_>,
    rows: std::ops::Range<usize>,
    chunks: &mut [f32],
    state: &mut RowState,
    sinks: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    for (local, row) in rows.enumerate() {
        if !run.row(row, false, chunks, state, sinks, local)? {
            run.row(row, true, chunks, state, sinks, local)?;
        }
    }
    Ok(())
}

/// An input's memory: rows over a host buffer's bytes, a donated activation (read from the task's
/// piece of output `output`'s sink, which it is written into), or a scalar's value.
enum Source<'a> {
    Rows(&'a [u8], Rows, DType),
    InPlace {
        output: usize,
        rows: Rows,
        dtype: DType,
    },
    Scalar(f64),
    /// Positions, each a row of every cache read at them (checked before the rows run).
    Positions(Vec<i64>),
}

/// One call's shared state, read by every task.
struct Run<'a> {
    program: &'a RowProgram,
    plan: &'a Schedule,
    /// Which element steps each pass computes, recalls or keeps.
    reuse: Reuse,
    /// Per step: exact in f32 ([`RowProgram::exact_in_f32`]).
    exact: Vec<bool>,
    binding: &'a Binding,
    sources: &'a [Source<'a>],
    /// Per output: elements from one row's start to the next in its sink.
    strides: Vec<usize>,
    /// Elements computed at a time per step: [`CHUNK`], or a whole row when the program pairs
    /// columns.
    chunk: usize,
}

/// What a task's rows reuse: each step's row value, whether it is computed in the current row, the
/// accumulators of the current pass, and the kept element values of the current row (a row of
/// `width` per slot).
struct RowState {
    values: Vec<f64>,
    computed: Vec<bool>,
    accumulators: Vec<(usize, Accumulator)>,
    kept: Vec<f32>,
}

/// What each pass does with its element steps: per pass, in order, each step it needs and whether
/// it reads the step's values back from a kept row instead of computing them; per step, its kept
/// row's slot and the pass that computes and keeps it.
#[derive(Debug)]
struct Reuse {
    actions: Vec<Vec<(usize, bool)>>,
    slot: Vec<Option<usize>>,
    computed_in: Vec<Option<usize>>,
    slots: usize,
}

impl Reuse {
    /// The plan for `program`'s `schedule`: an element step whose computation holds a
    /// transcendental step and which a later pass needs again is kept by the first pass that
    /// computes it and recalled by the later ones, which then skip what only it needed.
    fn plan(program: &RowProgram, schedule: &Schedule) -> Reuse {
        let steps = program.steps();
        let n = steps.len();
        let element = |v: ValueId| steps[v.0 as usize].extent == Extent::Element;
        // The element loops computing a value again from the loads costs: one per step of its cone,
        // a transcendental step counting as many.
        let mut cost = vec![0u32; n];
        for (index, step) in steps.iter().enumerate() {
            let of = |v: ValueId| if element(v) { cost[v.0 as usize] } else { 0 };
            cost[index] = match (step.extent, step.op) {
                (Extent::Row, _) => 0,
                (_, Op::Unary(op, x)) if TRANSCENDENTAL.contains(&op) => KEEP_COST.saturating_add(of(x)),
                (_, Op::Unary(_, x) | Op::Pair { x, .. }) => 1 + of(x),
                (_, Op::Binary(_, a, b)) => (1 + of(a)).saturating_add(of(b)),
                _ => 1,
            };
        }
        let costly: Vec<bool> = cost.iter().map(|&c| c >= KEEP_COST).collect();
        let passes = schedule.elements.len();
        let (mut slot, mut computed_in, mut slots) = (vec![None; n], vec![None; n], 0);
        let mut actions = Vec::with_capacity(passes);
        for (pass, elements) in schedule.elements.iter().enumerate() {
            let mut needed = vec![false; n];
            for &index in &schedule.reductions[pass] {
                let Op::Reduce { x, .. } = steps[index].op else { unreachable!("reductions are listed") };
                needed[x.0 as usize] = true;
            }
            if pass + 1 == passes {
                for output in program.outputs() {
                    if element(output.value) {
                        needed[output.value.0 as usize] = true;
                    }
                }
            }
            let mut pass_actions = Vec::with_capacity(elements.len());
            for &index in elements.iter().rev() {
                if !needed[index] {
                    continue;
                }
                if costly[index] && computed_in[index].is_some() {
                    pass_actions.push((index, true));
                    if slot[index].is_none() {
                        slot[index] = Some(slots);
                        slots += 1;
                    }
                    continue;
                }
                pass_actions.push((index, false));
                let mut need = |v: ValueId| {
                    if element(v) {
                        needed[v.0 as usize] = true;
                    }
                };
                match steps[index].op {
                    Op::Unary(_, x) | Op::Pair { x, .. } => need(x),
                    Op::Binary(_, a, b) => {
                        need(a);
                        need(b);
                    }
                    _ => {}
                }
            }
            pass_actions.reverse();
            for &(index, recall) in &pass_actions {
                if !recall && computed_in[index].is_none() {
                    computed_in[index] = Some(pass);
                }
            }
            actions.push(pass_actions);
        }
        Reuse { actions, slot, computed_in, slots }
    }
}

/// A reduction's running state in one row.
#[derive(Clone, Copy)]
struct Accumulator {
    /// The first `n` elements count.
    n: usize,
    lanes: [f32; LANES],
    /// The tree's result and the tail after it, once the tail began (f32 sums), or the running
    /// max.
    acc: Option<f32>,
    /// `sum`'s lanes, in f64.
    wide_lanes: [f64; LANES],
    /// `sum`'s tree result and tail.
    wide_acc: Option<f64>,
    /// The sum in `f64`, in column order (a row run again with exact sums).
    exact: f64,
}

impl Run<'_> {
    /// Runs rows `rows`, writing output `i`'s values for them into `sinks[i]` (the rows' bytes).
    #[inline(always)]
    fn rows(&self, rows: std::ops::Range<usize>, sinks: &mut [&mut [u8]]) -> Result<(), KernelError> {
        let steps = self.program.steps().len();
        // Per row, reset by `row`: each step's row value, whether it is computed, and the
        // accumulators of the pass's reductions.
        let mut state = RowState {
            values: vec![0f64; steps],
            computed: vec![false; steps],
            accumulators: Vec::with_capacity(self.plan.reductions.iter().map(Vec::len).max().unwrap_or(0)),
            kept: vec![
                0f32;
                self.reuse.slots.checked_mul(self.binding.width).ok_or_else(|| {
                    kernel_support::out_of_range(
                        "kept row elements",
                        self.binding.width,
                        0,
                        usize::MAX / self.reuse.slots.max(1),
                    )
                })?
            ],
        };
        // Every chunk value a step reads was written by the step before in the same chunk. The
        // rows run in a multiversioned function called from the closure: a closure's body is its
        // own function, compiled for the baseline CPU whatever function it is written in.
        let scratch = steps.checked_mul(self.chunk).ok_or_else(|| {
            kernel_support::out_of_range("row program scratch elements", self.chunk, 0, usize::MAX / steps.max(1))
        })?;
        crate::rows::with_scratch(scratch, |chunks: &mut [f32]| run_rows(self, rows, chunks, &mut state, sinks))
    }

    /// Runs one row; returns `false` (having written nothing) when an f32 sum is not finite and
    /// `exact` is off: the row is then run again with exact sums.
    #[inline(always)]
    fn row(
        &self,
        row: usize,
        exact: bool,
        chunks: &mut [f32],
        state: &mut RowState,
        sinks: &mut [&mut [u8]],
        local: usize,
    ) -> Result<bool, KernelError> {
        let (program, plan, width) = (self.program, self.plan, self.binding.width);
        let steps = program.steps();
        let passes = plan.elements.len();
        let RowState { values, computed, accumulators, kept } = state;
        computed.fill(false);
        for pass in 0..passes {
            self.row_values(pass, values, computed);
            accumulators.clear();
            for &index in &plan.reductions[pass] {
                let Op::Reduce { count, .. } = steps[index].op else { unreachable!("reductions are listed") };
                let n = match count {
                    None => width,
                    Some(count) => {
                        let c = values[count.0 as usize];
                        self.binding.checked_count(program, index, c)?
                    }
                };
                accumulators.push((
                    index,
                    Accumulator {
                        n,
                        lanes: [0.0; LANES],
                        acc: None,
                        wide_lanes: [0.0; LANES],
                        wide_acc: None,
                        exact: 0.0,
                    },
                ));
            }
            let last = pass + 1 == passes;
            let chunk_len = self.chunk;
            for start in (0..width).step_by(chunk_len) {
                let len = chunk_len.min(width - start);
                for &(index, recall) in &self.reuse.actions[pass] {
                    let slot = self.reuse.slot[index];
                    let chunk = index * chunk_len..index * chunk_len + len;
                    match slot {
                        Some(slot) if recall => {
                            chunks[chunk].copy_from_slice(&kept[slot * width + start..][..len]);
                        }
                        _ => {
                            self.element_step(index, (row, local), start, len, chunks, values, sinks);
                            if let Some(slot) = slot
                                && self.reuse.computed_in[index] == Some(pass)
                            {
                                kept[slot * width + start..][..len].copy_from_slice(&chunks[chunk]);
                            }
                        }
                    }
                }
                for (index, accumulator) in accumulators.iter_mut() {
                    let Op::Reduce { op, x, .. } = steps[*index].op else { unreachable!("reductions are listed") };
                    let x = &chunks[x.0 as usize * chunk_len..][..len];
                    accumulate(op, accumulator, start, x, exact);
                }
                if last {
                    self.store_elements(start, len, chunks, sinks, local);
                }
            }
            for &(index, accumulator) in accumulators.iter() {
                let Op::Reduce { op, .. } = steps[index].op else { unreachable!("reductions are listed") };
                let value = finish(op, accumulator, exact);
                if !exact && !value.is_finite() && op != ReduceOp::MaxAbs {
                    return Ok(false);
                }
                values[index] = self.round(steps[index].precision, value);
                computed[index] = true;
            }
        }
        self.row_values(passes, values, computed);
        for (output, sink) in program.outputs().iter().zip(sinks.iter_mut()) {
            if steps[output.value.0 as usize].extent == Extent::Row {
                let dtype = self.binding.output_dtype(output.dtype);
                let value = dtype.round(values[output.value.0 as usize]);
                dtype.element_writer()(sink, local, value);
            }
        }
        Ok(true)
    }

    /// Computes the row steps whose operands exist before pass `pass` (reductions are finished by
    /// their pass).
    #[inline(always)]
    fn row_values(&self, pass: usize, values: &mut [f64], computed: &mut [bool]) {
        for (index, step) in self.program.steps().iter().enumerate() {
            if computed[index] || step.extent != Extent::Row || self.plan.phase[index] > pass {
                continue;
            }
            let value = match step.op {
                Op::Param { input } => match self.sources[input] {
                    Source::Scalar(value) => value,
                    _ => unreachable!("a param reads a scalar"),
                },
                Op::Const(value) => value,
                Op::Width => self.binding.width as f64,
                Op::Unary(op, x) => op.eval(values[x.0 as usize]),
                Op::Binary(op, a, b) => op.eval(values[a.0 as usize], values[b.0 as usize]),
                Op::Reduce { .. } => continue,
                Op::Load { .. } | Op::Weight { .. } | Op::Cos { .. } | Op::Sin { .. } | Op::Pair { .. } => {
                    unreachable!("loads and rotary steps are element steps")
                }
            };
            values[index] = self.round(step.precision, value);
            computed[index] = true;
        }
    }

    fn round(&self, precision: Precision, value: f64) -> f64 {
        self.binding.precision_dtype(precision).map_or(value, |dtype| dtype.round(value))
    }

    /// Computes element step `index` over `len` elements from column `start` of `row` (the task's
    /// row `local`, whose piece of each sink is in `sinks`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn element_step(
        &self,
        index: usize,
        (row, local): (usize, usize),
        start: usize,
        len: usize,
        chunks: &mut [f32],
        values: &[f64],
        sinks: &[&mut [u8]],
    ) {
        let step = self.program.steps()[index];
        let chunk = self.chunk;
        let (before, rest) = chunks.split_at_mut(index * chunk);
        let out = &mut rest[..len];
        let operand = |v: ValueId| match self.program.steps()[v.0 as usize].extent {
            Extent::Element => Operand::Chunk(&before[v.0 as usize * chunk..][..len]),
            Extent::Row => Operand::Value(values[v.0 as usize] as f32),
        };
        match step.op {
            Op::Load { input, block } => match &self.sources[input] {
                Source::Rows(bytes, rows, dtype) => {
                    load(*dtype, bytes, rows.offset + row * rows.row_stride + block * self.binding.width + start, out);
                }
                // Read before this chunk of the row is written (`store_elements` runs after).
                Source::InPlace { output, rows, dtype } => {
                    load(*dtype, sinks[*output], local * rows.row_stride + block * self.binding.width + start, out);
                }
                Source::Scalar(_) | Source::Positions(_) => unreachable!("loads read rows"),
            },
            // A rotary program's row is one chunk (`Run::chunk`): `start` is 0 and `len` the width.
            Op::Cos { cache } | Op::Sin { cache } => {
                let (bytes, rows, dtype, rotated, neox, position) = self.cache_row(cache, row);
                let half = rotated / 2;
                let sin = matches!(step.op, Op::Sin { .. });
                // The pairs' cosines (or sines) into the first half, widened at once, then spread
                // over both columns of each pair (the sine negated on the first).
                let first = rows.offset + position * rows.row_stride + if sin { half } else { 0 };
                load(dtype, bytes, first, &mut out[..half]);
                let negate = |v: f32| if sin { -v } else { v };
                if neox {
                    let (firsts, rest) = out.split_at_mut(half);
                    rest[..half].copy_from_slice(firsts);
                    firsts.iter_mut().for_each(|v| *v = negate(*v));
                } else {
                    for i in (0..half).rev() {
                        let v = out[i];
                        (out[2 * i], out[2 * i + 1]) = (negate(v), v);
                    }
                }
                out[rotated..].fill(if sin { 0.0 } else { 1.0 });
            }
            Op::Pair { x, cache } => {
                let (_, _, _, rotated, neox, _) = self.cache_row(cache, row);
                let half = rotated / 2;
                let x = &before[x.0 as usize * chunk..][..len];
                if neox {
                    out[..half].copy_from_slice(&x[half..rotated]);
                    out[half..rotated].copy_from_slice(&x[..half]);
                } else {
                    for (o, x) in out[..rotated].chunks_exact_mut(2).zip(x.chunks_exact(2)) {
                        (o[0], o[1]) = (x[1], x[0]);
                    }
                }
                out[rotated..].fill(-0.0);
            }
            Op::Weight { input } => {
                let Source::Rows(bytes, rows, dtype) = &self.sources[input] else { unreachable!("weights are rows") };
                load(*dtype, bytes, rows.offset + start, out);
            }
            Op::Unary(_, _) | Op::Binary(..)
                if !self.exact[index] && narrower_than_f32(self.binding.precision_dtype(step.precision)) =>
            {
                // Rounded to a type narrower than f32: the operation in f64, rounded once, as the
                // reference (an f32 result rounded again could land on the other side of a tie).
                let dtype = self.binding.precision_dtype(step.precision).expect("narrower than f32");
                let wide = |v: ValueId, i: usize| match self.program.steps()[v.0 as usize].extent {
                    Extent::Element => f64::from(before[v.0 as usize * chunk + i]),
                    Extent::Row => values[v.0 as usize],
                };
                for (i, o) in out.iter_mut().enumerate() {
                    let exact = match step.op {
                        Op::Unary(op, x) => op.eval(wide(x, i)),
                        Op::Binary(op, a, b) => op.eval(wide(a, i), wide(b, i)),
                        _ => unreachable!("matched above"),
                    };
                    *o = dtype.round(exact) as f32;
                }
                return;
            }
            Op::Unary(op, x) => {
                let Operand::Chunk(x) = operand(x) else { unreachable!("an element step's operand is elements") };
                unary_chunk(op, x, out);
            }
            Op::Binary(op, a, b) => binary_chunk(op, operand(a), operand(b), out),
            Op::Param { .. } | Op::Const(_) | Op::Width | Op::Reduce { .. } => {
                unreachable!("row steps are not element steps")
            }
        }
        if let Some(dtype) = self.binding.precision_dtype(step.precision) {
            round_chunk(dtype, out);
        }
    }

    /// Cache `cache`'s memory, rows and dtype, its rotated width and style, and the cache row that
    /// row `row` reads (its position, checked before the rows run).
    #[inline(always)]
    fn cache_row(&self, cache: usize, row: usize) -> (&[u8], Rows, DType, usize, bool, usize) {
        let InputKind::CosSinCache { positions, neox } = self.program.inputs()[cache].kind else {
            unreachable!("a built program reads caches as caches")
        };
        let (Source::Rows(bytes, rows, dtype), Source::Positions(at)) =
            (&self.sources[cache], &self.sources[positions])
        else {
            unreachable!("caches are rows and positions are read as such")
        };
        let position = at[row / (self.binding.rows / at.len())] as usize;
        (bytes, *rows, *dtype, rows.hidden, neox, position)
    }

    /// Stores the element outputs' chunk `start..start + len` of the current row.
    #[inline(always)]
    fn store_elements(&self, start: usize, len: usize, chunks: &[f32], sinks: &mut [&mut [u8]], local: usize) {
        let steps = self.program.steps();
        for ((output, sink), stride) in self.program.outputs().iter().zip(sinks.iter_mut()).zip(&self.strides) {
            let value = output.value.0 as usize;
            if steps[value].extent != Extent::Element {
                continue;
            }
            let dtype = self.binding.output_dtype(output.dtype);
            let size = dtype.size_in_bytes();
            let first = local * stride + start;
            let bytes = &mut sink[first * size..(first + len) * size];
            store(dtype, &chunks[value * self.chunk..][..len], bytes);
        }
    }
}

/// Whether values rounded to `dtype` keep fewer bits than f32 (f16, bf16, fp8).
fn narrower_than_f32(dtype: Option<DType>) -> bool {
    matches!(dtype, Some(DType::F16 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2))
}

/// An element step's operand: a chunk of element values, or a row value (broadcast).
#[derive(Clone, Copy)]
enum Operand<'a> {
    Chunk(&'a [f32]),
    Value(f32),
}

/// Widens `out.len()` elements of `dtype` from element `start` of `bytes` (aligned to `dtype`).
#[inline(always)]
fn load(dtype: DType, bytes: &[u8], start: usize, out: &mut [f32]) {
    /// The whole elements of `bytes` (a donated storage's tail may end inside one).
    fn elements<T: bytemuck::Pod>(bytes: &[u8]) -> &[T] {
        bytemuck::cast_slice(&bytes[..bytes.len() / size_of::<T>() * size_of::<T>()])
    }
    fn typed<T: CpuElement>(bytes: &[u8], start: usize, out: &mut [f32]) {
        T::load(&elements::<T>(bytes)[start..start + out.len()], out);
    }
    match dtype {
        DType::F32 => out.copy_from_slice(&elements::<f32>(bytes)[start..start + out.len()]),
        DType::F16 => typed::<half::f16>(bytes, start, out),
        DType::BF16 => typed::<half::bf16>(bytes, start, out),
        // f64 activations are refused; an f64 weight or scalar tensor on f32 rows rounds here.
        other => {
            let read = other.element_reader();
            for (index, value) in out.iter_mut().enumerate() {
                *value = read(bytes, start + index) as f32;
            }
        }
    }
}

/// Rounds `values` to `dtype` (f32 and f64 hold them already).
#[inline(always)]
fn round_chunk(dtype: DType, values: &mut [f32]) {
    match dtype {
        DType::F32 | DType::F64 => {}
        DType::F16 => <half::f16 as CpuElement>::round_in_place(values),
        DType::BF16 => <half::bf16 as CpuElement>::round_in_place(values),
        DType::F8E4M3FN => values.iter_mut().for_each(|v| *v = F8E4M3::from_bits(E4M3::encode(*v)).to_f32()),
        DType::F8E5M2 => values.iter_mut().for_each(|v| *v = F8E5M2::from_bits(E5M2::encode(*v)).to_f32()),
        other => values.iter_mut().for_each(|v| *v = other.round(f64::from(*v)) as f32),
    }
}

/// Stores `values` as `dtype` elements into `bytes` (rounding to it).
#[inline(always)]
fn store(dtype: DType, values: &[f32], bytes: &mut [u8]) {
    fn typed<T: CpuElement>(values: &[f32], bytes: &mut [u8]) {
        T::store(values, bytemuck::cast_slice_mut(bytes));
    }
    match dtype {
        DType::F32 => bytemuck::cast_slice_mut::<u8, f32>(bytes).copy_from_slice(values),
        DType::F16 => typed::<half::f16>(values, bytes),
        DType::BF16 => typed::<half::bf16>(values, bytes),
        DType::F8E4M3FN => bytes.iter_mut().zip(values).for_each(|(b, &v)| *b = E4M3::encode(v)),
        DType::F8E5M2 => bytes.iter_mut().zip(values).for_each(|(b, &v)| *b = E5M2::encode(v)),
        other => {
            let write = other.element_writer();
            for (index, &value) in values.iter().enumerate() {
                write(bytes, index, other.round(f64::from(value)));
            }
        }
    }
}

/// `out[i] = op(x[i])` in f32, one loop per operation.
#[inline(always)]
fn unary_chunk(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    fn map(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = f(v);
        }
    }
    match op {
        UnaryOp::Neg => map(x, out, |v| -v),
        UnaryOp::Abs => map(x, out, f32::abs),
        UnaryOp::Exp => crate::gated::map_into(&rten_vecmath::Exp {}, x, out),
        UnaryOp::Tanh => crate::gated::map_into(&rten_vecmath::Tanh {}, x, out),
        UnaryOp::Erf => map(x, out, libm::erff),
        UnaryOp::Erfc => map(x, out, libm::erfcf),
        UnaryOp::Sigmoid => crate::gated::map_into(&rten_vecmath::Sigmoid {}, x, out),
        UnaryOp::Sqrt => map(x, out, f32::sqrt),
        UnaryOp::Recip => map(x, out, |v| 1.0 / v),
        UnaryOp::Relu => map(x, out, |v| if v < 0.0 { 0.0 } else { v }),
        UnaryOp::Round => out.copy_from_slice(x),
    }
}

/// `out[i] = op(a[i], b[i])` in f32 (a row value broadcast), one loop per operation and operand
/// form.
#[inline(always)]
fn binary_chunk(op: BinaryOp, a: Operand<'_>, b: Operand<'_>, out: &mut [f32]) {
    #[inline(always)]
    fn zip(a: Operand<'_>, b: Operand<'_>, out: &mut [f32], f: impl Fn(f32, f32) -> f32) {
        match (a, b) {
            (Operand::Chunk(a), Operand::Chunk(b)) => {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            }
            (Operand::Chunk(a), Operand::Value(y)) => {
                for (o, &x) in out.iter_mut().zip(a) {
                    *o = f(x, y);
                }
            }
            (Operand::Value(x), Operand::Chunk(b)) => {
                for (o, &y) in out.iter_mut().zip(b) {
                    *o = f(x, y);
                }
            }
            (Operand::Value(x), Operand::Value(y)) => out.fill(f(x, y)),
        }
    }
    match op {
        BinaryOp::Add => zip(a, b, out, |x, y| x + y),
        BinaryOp::Sub => zip(a, b, out, |x, y| x - y),
        BinaryOp::Mul => zip(a, b, out, |x, y| x * y),
        BinaryOp::Div => zip(a, b, out, |x, y| x / y),
        // `minimumNumber` and `maximumNumber` (`ir_ops::row_program::minimum_number`), branch-free.
        BinaryOp::Min => {
            zip(a, b, out, |x, y| if x < y || (x == y && x.is_sign_negative()) || y.is_nan() { x } else { y })
        }
        BinaryOp::Max => {
            zip(a, b, out, |x, y| if x > y || (x == y && y.is_sign_negative()) || y.is_nan() { x } else { y })
        }
    }
}

/// Adds the chunk of elements `start..start + x.len()` to a reduction.
#[inline(always)]
fn accumulate(op: ReduceOp, accumulator: &mut Accumulator, start: usize, x: &[f32], exact: bool) {
    let n = accumulator.n;
    if start >= n {
        return;
    }
    let x = &x[..x.len().min(n - start)];
    match (op, exact) {
        (ReduceOp::MaxAbs, _) => {
            let max = x.iter().fold(accumulator.acc.unwrap_or(0.0), |m, v| m.max(v.abs()));
            accumulator.acc = Some(max);
        }
        (ReduceOp::Sum, true) => accumulator.exact = x.iter().fold(accumulator.exact, |s, &v| s + f64::from(v)),
        (ReduceOp::SumSquares, true) => {
            accumulator.exact = x.iter().fold(accumulator.exact, |s, &v| s + f64::from(v) * f64::from(v));
        }
        (ReduceOp::Sum, false) => wide_lanes(accumulator, start, x),
        (ReduceOp::SumSquares, false) => lanes(accumulator, start, x, |v| v * v),
    }
}

/// The f32 sum: 32 lanes over the full 32-element groups in order, then the tree and the tail.
#[inline(always)]
fn lanes(accumulator: &mut Accumulator, start: usize, x: &[f32], term: impl Fn(f32) -> f32) {
    // `start` is a multiple of the chunk (of 32 lanes), so this chunk's part below `full` is whole
    // groups.
    let full = accumulator.n - accumulator.n % LANES;
    let grouped = full.saturating_sub(start).min(x.len());
    let (groups, _) = x[..grouped].as_chunks::<LANES>();
    let mut lanes = accumulator.lanes;
    for group in groups {
        for i in 0..LANES {
            lanes[i] += term(group[i]);
        }
    }
    accumulator.lanes = lanes;
    for &v in &x[grouped..] {
        let acc = accumulator.acc.get_or_insert_with(|| tree(accumulator.lanes));
        *acc += term(v);
    }
}

/// `sum` in 32 f64 lanes over the full 32-element groups in order, then the tree and the tail
/// (the gated ops' row statistics' order): a mean far from zero keeps its bits, so what is subtracted
/// from each element cancels it exactly where the reference's does.
#[inline(always)]
fn wide_lanes(accumulator: &mut Accumulator, start: usize, x: &[f32]) {
    let full = accumulator.n - accumulator.n % LANES;
    let grouped = full.saturating_sub(start).min(x.len());
    let (groups, _) = x[..grouped].as_chunks::<LANES>();
    let mut lanes = accumulator.wide_lanes;
    for group in groups {
        for i in 0..LANES {
            lanes[i] += f64::from(group[i]);
        }
    }
    accumulator.wide_lanes = lanes;
    for &v in &x[grouped..] {
        let acc = accumulator.wide_acc.get_or_insert_with(|| tree(accumulator.wide_lanes));
        *acc += f64::from(v);
    }
}

/// The lanes summed by the fixed tree every cpu norm uses (f32 lanes; f64 for sums).
#[inline(always)]
fn tree<T: Copy + std::ops::AddAssign>(mut lanes: [T; LANES]) -> T {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            let other = lanes[i + width];
            lanes[i] += other;
        }
    }
    lanes[0]
}

fn finish(op: ReduceOp, accumulator: Accumulator, exact: bool) -> f64 {
    match op {
        ReduceOp::MaxAbs => f64::from(accumulator.acc.unwrap_or(0.0)),
        _ if exact => accumulator.exact,
        ReduceOp::Sum => accumulator.wide_acc.unwrap_or_else(|| tree(accumulator.wide_lanes)),
        ReduceOp::SumSquares => f64::from(accumulator.acc.unwrap_or_else(|| tree(accumulator.lanes))),
    }
}

#[cfg(test)]
mod tests;
