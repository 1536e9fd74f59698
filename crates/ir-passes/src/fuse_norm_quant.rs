//! The `fuse_norm_quant` pass ([`fuse_norm_quant`] documents it).

use crate::analysis::FusionFacts;
use cranelift_entity::{EntitySet, SecondaryMap};
use ir_core::TensorMeta;
use ir_core::builtin::Builtin;
use ir_core::op::{OpDef, Overload, StrEnum};
use ir_graph::{Arg, BuiltinArg, Graph, NodeId, NodeKind, ValueId};
use ir_ops::Rounding;
use ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT;
use ir_ops::fused_add_rms_norm::{FUSED_ADD_RMS_NORM, FusedAddRmsNormArgs};
use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
use ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT;
use ir_ops::rms_norm::{RMS_NORM, RmsNormArgs};
use ir_ops::rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
use ir_ops::rms_norm_static_fp8_quant::RMS_NORM_STATIC_FP8_QUANT;
use ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT;

use crate::analysis::{DecidedFusion, FusionSite, replace_uses, split_misplaced};
use crate::{FusionReport, FusionSkip, PassContext, PassError};

/// A norm, a quantization and their fused op, by their definitions.
struct Pattern {
    norm: &'static OpDef,
    quant: &'static OpDef,
    fused: &'static OpDef,
}

/// The quantizations some pattern fuses.
const QUANTS: [&OpDef; 2] = [&STATIC_SCALED_FP8_QUANT, &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT];

/// The position of a fusable norm's `variance_size`: the parameters before it are the fused ops'
/// first ones.
fn variance_size_index(norm: &OpDef) -> usize {
    if std::ptr::eq(norm, &FUSED_ADD_RMS_NORM) {
        FusedAddRmsNormArgs::variance_size
    } else {
        RmsNormArgs::variance_size
    }
}

/// The pairs with a fused op.
static PATTERNS: [Pattern; 4] = [
    Pattern { norm: &RMS_NORM, quant: &STATIC_SCALED_FP8_QUANT, fused: &RMS_NORM_STATIC_FP8_QUANT },
    Pattern { norm: &RMS_NORM, quant: &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT, fused: &RMS_NORM_DYNAMIC_PER_TOKEN_QUANT },
    Pattern { norm: &FUSED_ADD_RMS_NORM, quant: &STATIC_SCALED_FP8_QUANT, fused: &FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT },
    Pattern {
        norm: &FUSED_ADD_RMS_NORM,
        quant: &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT,
        fused: &FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
    },
];

/// One fusion decided on the unmodified graph.
struct Fusion {
    norm: NodeId,
    quant: NodeId,
    /// A reshape between the two, and its shape.
    reshape: Option<(NodeId, Vec<usize>)>,
    /// The fused op's result metadata.
    metas: Vec<TensorMeta>,
    /// The node the fused call goes right before.
    anchor: NodeId,
    fused: &'static str,
    /// The norm's arguments without `variance_size`, then the quantization's after its input.
    args: Vec<Arg>,
    /// The values the fused call's results replace (through the moved reshape for `q` and the
    /// scales), in its result order.
    replaced: Vec<ValueId>,
    /// How many leading results are the norm's (the residual), which no reshape touches.
    norm_results: usize,
    /// The quantization's statement, printed (for the report, should a later check keep the pair).
    statement: String,
}

impl DecidedFusion for Fusion {
    fn site(&self) -> FusionSite<'_> {
        FusionSite {
            anchor: self.anchor,
            args: &self.args,
            removed: [self.norm, self.quant].into_iter().chain(self.reshape.as_ref().map(|(node, _)| *node)).collect(),
            replaced: &self.replaced,
        }
    }
}

/// Norm + quantization fusion: an fp8 quantization whose input is an RMS norm's output, and that
/// output's only reader, becomes one norm + quantization call, so the normalized row is never
/// written to memory. Every pair of a norm and a quantization has a fused op:
///
/// | norm | quantization | fused op (results) |
/// |---|---|---|
/// | `rms_norm` | `static_scaled_fp8_quant` | `rms_norm_static_fp8_quant` (`q`) |
/// | `rms_norm` | `dynamic_per_token_scaled_fp8_quant` | `rms_norm_dynamic_per_token_quant` (`q`, `scales`) |
/// | `fused_add_rms_norm` | `static_scaled_fp8_quant` | `fused_add_rms_norm_static_fp8_quant` (`residual_out`, `q`) |
/// | `fused_add_rms_norm` | `dynamic_per_token_scaled_fp8_quant` | `fused_add_rms_norm_dynamic_per_token_quant` (`residual_out`, `q`, `scales`) |
///
/// ```text
/// %o = rms_norm(%x, %w, 1e-6, none) : bf16[8,16]                 %q2 = rms_norm_static_fp8_quant(%x, %w, 1e-6, %s, f8e4m3fn)
/// %q = static_scaled_fp8_quant(%o, %s, f8e4m3fn) : f8e4m3fn[8,16]  →      : f8e4m3fn[8,16]
/// output(%q)                                                      output(%q2)
/// ```
///
/// Notation: `o` is the norm's normalized output, `q` the quantization's call. The pass matches
/// functional calls only: it runs after `functionalize` in the standard pipeline (a `maybe_inplace`
/// norm is reported and kept).
///
/// # When a candidate is fused
///
/// Every functional quantization whose input is a norm's normalized output is a candidate. It is
/// fused when all of these hold, and otherwise reported with the first that fails
/// ([`FusionSkip`]):
///
/// - **The norm is functional** ([`FusionSkip::Donated`]).
/// - **No `variance_size`** ([`FusionSkip::VarianceSize`]): the fused ops normalize whole rows.
/// - **One rounding** ([`FusionSkip::RoundingDiffers`]): the fused op takes one `rounding` for the
///   norm's sum and the static scale. A 16-bit `fused_add_rms_norm` and a static quantization
///   with different `rounding`s stay apart; otherwise the fused op takes the rounding that matters
///   (the static quantization's, or the norm's), so `rounding = "dtype"` pairs fuse with `"dtype"`.
/// - **The quantization is `o`'s only reader** ([`FusionSkip::OtherReaders`]): another reader,
///   the graph's output included, needs `o` in memory, so fusing would compute the norm twice.
///   ```text
///   %o = rms_norm(%x, none, 1e-6, none) : f32[2,8]
///   %q = static_scaled_fp8_quant(%o, %s, f8e4m3fn) : f8e4m3fn[2,8]
///   output(%q, %o)                          // o is an output: kept as is
///   ```
/// - **A place for the fused call** ([`FusionSkip::NoPlace`]): it takes the quantization's place
///   when nothing reads the norm's residual output before it, else the norm's place when the
///   quantization's scale is defined before the norm; otherwise the pair stays.
/// - **Nothing is written between them** ([`FusionSkip::WriteBetween { first: "norm", second: "quantization" }`]): one of the two calls
///   moves to the other's place, so a write in between could change what it reads.
/// - **Every operand is there where the fused call stands** ([`FusionSkip::OperandNotReady`]):
///   the call reads no value the pair computes or that depends on it, and none defined after its
///   place, counting a value another fusion replaces as defined where that fusion's call stands
///   (checked once every pair is decided, dropping pairs until all that remain fit).
///   ```text
///   %o, %res = fused_add_rms_norm(%x, %r, none, 1e-6, none) : f32[1], f32[1]
///   %q = static_scaled_fp8_quant(%o, %res, f8e4m3fn) : f8e4m3fn[1]  // the scale is the residual: kept
///   ```
/// - **The fused op gives the same metadata** ([`FusionSkip::Metadata`]): its results must have
///   the dtype, device and layout of the values they replace (a norm of a strided view returns a
///   compact output either way; the fused op's predicate-free meta function is the judge).
///
/// # Reshapes between the two
///
/// A `reshape` of the normalized output that only the quantization reads (splitting heads, say)
/// does not block fusion: the fused op quantizes the unreshaped rows and the reshape moves after
/// it, onto `q` (and onto the per-token scales, `[..., 1]`). Static quantization is elementwise, so
/// any reshape commutes with it; a per-token quantization's rows are the last dimension, so the
/// reshape must keep it ([`FusionSkip::ReshapeChangesRows`]).
///
/// ```text
/// %o = rms_norm(%x, %w, 1e-6, none) : bf16[4,64]                %0 = rms_norm_static_fp8_quant(%x, %w, 1e-6, %s, f8e4m3fn)
/// %v = reshape(%o, [4, 2, 32]) : bf16[4,2,32]              →         : f8e4m3fn[4,64]
/// %q = static_scaled_fp8_quant(%v, %s, f8e4m3fn)                %1 = reshape(%0, [4, 2, 32]) : f8e4m3fn[4,2,32]
///        : f8e4m3fn[4,2,32]
/// ```
///
/// # Rounding
///
/// Each fused op's semantics are the composition of the pair (the norm's output rounded to x's
/// dtype, then quantized), so the pass changes no result of the reference; the cpu provider's fused
/// kernels are its unfused kernels composed, bit for bit. A GPU provider's fused kernel sums the
/// squares in another order than its norm kernel may, so on a GPU the fused result can differ from
/// the unfused pair's by one step of the fp8 format (the ops' tolerance), as two providers may.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, fuse_norm_quant};
///
/// let mut graph = parse(
///     "graph g(%x: f32[2,8], %w: f32[8], %s: f32[1]) {
///        %o = rms_norm(%x, %w, 1e-6, none) : f32[2,8]
///        %q = static_scaled_fp8_quant(%o, %s, f8e4m3fn) : f8e4m3fn[2,8]
///        output(%q)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = fuse_norm_quant(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.fused.len(), 1);
/// assert!(graph.to_string().contains("= rms_norm_static_fp8_quant(%x, %w, 1e-6, %s, f8e4m3fn) : f8e4m3fn[2,8]"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Fuses every norm + quantization pair the rules above allow.
///
/// Linear: one pass decides every fusion on the unmodified graph (positions, use lists and a prefix
/// count of writing nodes answer each rule in constant time per use), one more rewrites the uses.
pub fn fuse_norm_quant(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FusionReport, PassError> {
    let _span = tracing::info_span!("pass", name = "fuse-norm-quant").entered();
    let mut report = FusionReport::new("norm + quantization");
    // The analyses below read the whole graph: a graph that calls no quantization skips them.
    if !QUANTS.iter().any(|quant| graph.mentions_op(quant)) {
        return Ok(report);
    }
    let FusionFacts { positions, uses, writes_before } = FusionFacts::compute(graph, cx);

    let mut fusions = Vec::new();
    for &quant in graph.order() {
        let Some((quant_def, quant_args)) =
            QUANTS.iter().find_map(|&def| graph.functional_call_of(quant, def).map(|args| (def, args)))
        else {
            continue;
        };
        // Both quantizations take x first.
        let Some(&Arg::Tensor(quant_input)) = quant_args.first() else { continue };
        // A reshape between the norm and the quantization moves after the fused call.
        let (normalized, reshape) = match graph.builtin_defining(quant_input, Builtin::Reshape) {
            Some((node, [BuiltinArg::Value(source), BuiltinArg::Shape(dims)])) => (*source, Some((node, dims.clone()))),
            Some(_) => continue,
            None => (quant_input, None),
        };
        let normalized = &normalized;
        let norm = graph.value(*normalized).def;
        // Every norm and quantization pair has a fused op.
        let Some((pattern, (overload, norm_args))) = PATTERNS
            .iter()
            .filter(|p| std::ptr::eq(p.quant, quant_def))
            .find_map(|p| graph.ir_call_of(norm, p.norm).map(|call| (p, call)))
        else {
            continue;
        };
        if graph.node(norm).results.first() != Some(normalized) {
            continue;
        }
        let statement = graph.display_node(quant);
        let skip = |reason| (statement.clone(), reason);
        if overload != Overload::Default {
            report.skipped.push(skip(FusionSkip::Donated));
            continue;
        }
        // The norm's arguments before `variance_size` go to the fused op; `variance_size` must be
        // absent, which the fused ops compute.
        let variance_at = variance_size_index(pattern.norm);
        if !matches!(norm_args.get(variance_at), None | Some(Arg::None)) {
            report.skipped.push(skip(FusionSkip::VarianceSize));
            continue;
        }
        // The fused norm's `rounding` (after `variance_size`) matters on a 16-bit sum; a static
        // quantization's (its last parameter) always does. The fused op takes one for both.
        let is_static = std::ptr::eq(quant_def, &STATIC_SCALED_FP8_QUANT);
        let norm_rounding = rounding_arg(norm_args.get(variance_at + 1));
        let quant_rounding = is_static.then(|| rounding_arg(quant_args.get(STATIC_ROUNDING)));
        let sum_matters = std::ptr::eq(pattern.norm, &FUSED_ADD_RMS_NORM)
            && Rounding::Dtype.rounds_intermediates(graph.meta(*normalized).dtype);
        let rounding = match quant_rounding {
            Some(quant) if sum_matters && quant != norm_rounding => {
                let (norm, quantization) = (norm_rounding.as_str(), quant.as_str());
                report.skipped.push(skip(FusionSkip::RoundingDiffers { norm, quantization }));
                continue;
            }
            Some(quant) => quant,
            None => norm_rounding,
        };
        // The quantization's arguments after x and before its `rounding`.
        let quant_scalars = &quant_args[1..quant_args.len().min(QUANT_OUT_DTYPE + 1)];
        let read_by_scalars =
            quant_scalars.iter().any(|a| matches!(a, Arg::Tensor(v) if v == normalized || *v == quant_input));
        let other_readers = match &reshape {
            Some((reshape_node, _)) => {
                uses[*normalized].iter().any(|&user| user != *reshape_node)
                    || uses[quant_input].iter().any(|&user| user != quant)
            }
            None => uses[*normalized].iter().any(|&user| user != quant),
        };
        if other_readers || read_by_scalars {
            report.skipped.push(skip(FusionSkip::OtherReaders));
            continue;
        }
        let per_token = std::ptr::eq(quant_def, &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT);
        let rows_change =
            reshape.as_ref().is_some_and(|(_, dims)| dims.last() != graph.meta(*normalized).shape().last());
        if per_token && rows_change {
            report.skipped.push(skip(FusionSkip::ReshapeChangesRows));
            continue;
        }
        let (norm_at, quant_at) = (positions[norm] as usize, positions[quant] as usize);
        let residual_read_first = graph.node(norm).results[1..]
            .iter()
            .any(|&r| uses[r].iter().any(|&user| (positions[user] as usize) < quant_at));
        let anchor = if !residual_read_first {
            quant
        } else if quant_scalars.iter().all(|arg| match arg {
            Arg::Tensor(v) => (positions[graph.value(*v).def] as usize) < norm_at,
            _ => true,
        }) {
            norm
        } else {
            report.skipped.push(skip(FusionSkip::NoPlace));
            continue;
        };
        if writes_before[quant_at] - writes_before[norm_at + 1] > 0 {
            report.skipped.push(skip(FusionSkip::WriteBetween { first: "norm", second: "quantization" }));
            continue;
        }
        let mut args: Vec<Arg> = norm_args[..variance_at.min(norm_args.len())].to_vec();
        args.extend(quant_scalars.iter().cloned());
        if rounding != Rounding::Exact {
            // The fused op's `rounding` is its last parameter: the defaults before it are spelled.
            let fused_def = pattern.fused;
            while args.len() + 1 < fused_def.params.len() {
                match fused_def.params[args.len()].default.and_then(literal_arg) {
                    Some(arg) => args.push(arg),
                    None => break,
                }
            }
            args.push(Arg::Str(rounding.as_str().to_owned()));
        }
        let quant_results = &graph.node(quant).results;
        let norm_results = usize::from(std::ptr::eq(pattern.norm, &FUSED_ADD_RMS_NORM));
        let replaced: Vec<ValueId> =
            graph.node(norm).results[1..=norm_results].iter().chain(quant_results).copied().collect();
        let metas = match fused_metadata(graph, cx, pattern.fused.name, &args, &replaced, norm_results, &reshape) {
            Ok(metas) => metas,
            Err(why) => {
                report.skipped.push(skip(FusionSkip::Metadata(why)));
                continue;
            }
        };
        fusions.push(Fusion {
            norm,
            quant,
            reshape,
            metas,
            anchor,
            fused: pattern.fused.name,
            args,
            replaced,
            norm_results,
            statement,
        });
    }
    let (fusions, dropped) = split_misplaced(graph, &positions, fusions);
    for (fusion, operand) in dropped {
        report.skipped.push((fusion.statement, FusionSkip::OperandNotReady { operand }));
    }
    if fusions.is_empty() {
        return Ok(report);
    }

    let mut replacement: SecondaryMap<ValueId, Option<ValueId>> = SecondaryMap::new();
    let mut placements = Vec::with_capacity(fusions.len());
    let mut removed = EntitySet::new();
    let mut created = Vec::with_capacity(fusions.len());
    for fusion in fusions {
        let op = graph.op_ref(fusion.fused);
        let kind = NodeKind::IrCall { op, overload: Overload::Default, args: fusion.args };
        let (node, results) = graph.create_detached(kind, fusion.metas);
        placements.push((fusion.anchor, node));
        for (index, (&old, &new)) in fusion.replaced.iter().zip(&results).enumerate() {
            let moved_reshape = fusion.reshape.as_ref().filter(|_| index >= fusion.norm_results);
            let Some((_, dims)) = moved_reshape else {
                replacement[old] = Some(new);
                continue;
            };
            // q takes the reshape's shape; the per-token scales its leading dimensions and 1.
            let shape = if index > fusion.norm_results { scales_shape(dims) } else { dims.clone() };
            let kind = NodeKind::builtin(Builtin::Reshape, vec![BuiltinArg::Value(new), BuiltinArg::Shape(shape)]);
            let (reshaped, values) = graph.create_detached(kind, vec![graph.meta(old).clone()]);
            placements.push((fusion.anchor, reshaped));
            replacement[old] = Some(values[0]);
        }
        removed.insert(fusion.norm);
        removed.insert(fusion.quant);
        if let Some((reshape, _)) = fusion.reshape {
            removed.insert(reshape);
        }
        created.push(node);
    }
    graph.insert_detached_before(&placements);
    graph.remove_nodes(&removed);
    replace_uses(graph, &replacement);
    report.fused = created.iter().map(|&node| graph.display_node(node)).collect();
    tracing::debug!(target: "ir_passes::fuse_norm_quant", %report, "fused");
    Ok(report)
}

/// Where both quantizations keep `out_dtype`, the last argument the fused ops take from them.
const QUANT_OUT_DTYPE: usize = 2;
/// Where `static_scaled_fp8_quant` keeps its `rounding`.
const STATIC_ROUNDING: usize = 3;

/// A `rounding` argument (absent: the default).
fn rounding_arg(arg: Option<&Arg>) -> Rounding {
    match arg {
        Some(Arg::Str(text)) if text == Rounding::Dtype.as_str() => Rounding::Dtype,
        _ => Rounding::Exact,
    }
}

/// A parameter's default as a graph argument (the constants a fused call spells before its
/// `rounding`).
fn literal_arg(literal: ir_core::op::Literal) -> Option<Arg> {
    match literal {
        ir_core::op::Arg::None => Some(Arg::None),
        ir_core::op::Arg::DType(dtype) => Some(Arg::DType(dtype)),
        ir_core::op::Arg::Str(text) => Some(Arg::Str(text.to_owned())),
        ir_core::op::Arg::F64(v) => Some(Arg::F64(v)),
        ir_core::op::Arg::I64(v) => Some(Arg::I64(v)),
        ir_core::op::Arg::Bool(v) => Some(Arg::Bool(v)),
        _ => None,
    }
}

/// The per-token scales' shape for a reshape to `dims`: its leading dimensions, then 1.
fn scales_shape(dims: &[usize]) -> Vec<usize> {
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = 1;
    }
    shape
}

/// The fused op's result metadata when, bound to `args`, it gives exactly the metadata of
/// `replaced` (after the moved reshape, for the results past the norm's).
fn fused_metadata(
    graph: &Graph,
    cx: &PassContext<'_>,
    fused: &str,
    args: &[Arg],
    replaced: &[ValueId],
    norm_results: usize,
    reshape: &Option<(NodeId, Vec<usize>)>,
) -> Result<Vec<TensorMeta>, String> {
    let def = cx.registry.op_def(fused).ok_or_else(|| format!("the registry does not define `{fused}`"))?;
    let metas = args.iter().map(|arg| graph.arg_meta(arg)).collect();
    let outputs = def.output_metas(metas).map_err(|e| e.to_string())?;
    if outputs.len() != replaced.len() {
        return Err(format!("it has {} results, not {}", outputs.len(), replaced.len()));
    }
    for (index, (got, &value)) in outputs.iter().zip(replaced).enumerate() {
        let want = graph.meta(value);
        let got = match reshape {
            Some((_, dims)) if index >= norm_results => {
                let shape = if index > norm_results { scales_shape(dims) } else { dims.clone() };
                let layout = got.layout.reshape(&shape).map_err(|e| e.to_string())?;
                TensorMeta { layout, ..got.clone() }
            }
            _ => got.clone(),
        };
        if got != *want {
            return Err(format!("its result {index} would be {got}, not {want}"));
        }
    }
    Ok(outputs)
}
