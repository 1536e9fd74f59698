//! The `fuse_add_rms_norm` pass ([`fuse_add_rms_norm`] documents it), and the add + norm fusion it
//! shares with `fuse-row-programs` (add + `layer_norm`).

use crate::analysis::FusionFacts;
use cranelift_entity::EntitySet;
use ir_core::TensorMeta;
use ir_core::builtin::Builtin;
use ir_core::op::{OpDef, StrEnum};
use ir_graph::{Arg, Graph, NodeId, ValueId};
use ir_ops::fused_add_layer_norm::{FUSED_ADD_LAYER_NORM, FusedAddLayerNormArgs};
use ir_ops::fused_add_rms_norm::{FUSED_ADD_RMS_NORM, FusedAddRmsNormArgs};
use ir_ops::layer_norm::{LAYER_NORM, LayerNormArgs};
use ir_ops::rms_norm::{RMS_NORM, RmsNormArgs};

// The fused call's arguments are the sum's two operands, then the norm's arguments after `x`, in
// the norm's order, then the fused op's `rounding`.
const _: () = assert!(
    RmsNormArgs::x == 0
        && FusedAddRmsNormArgs::x == 0
        && FusedAddRmsNormArgs::x_residual == 1
        && FusedAddRmsNormArgs::weight == RmsNormArgs::weight + 1
        && FusedAddRmsNormArgs::epsilon == RmsNormArgs::epsilon + 1
        && FusedAddRmsNormArgs::variance_size == RmsNormArgs::variance_size + 1
        && FusedAddRmsNormArgs::rounding == FusedAddRmsNormArgs::variance_size + 1
);
const _: () = assert!(
    LayerNormArgs::x == 0
        && FusedAddLayerNormArgs::x == 0
        && FusedAddLayerNormArgs::x_residual == 1
        && FusedAddLayerNormArgs::weight == LayerNormArgs::weight + 1
        && FusedAddLayerNormArgs::bias == LayerNormArgs::bias + 1
        && FusedAddLayerNormArgs::epsilon == LayerNormArgs::epsilon + 1
        && FusedAddLayerNormArgs::rounding == FusedAddLayerNormArgs::epsilon + 1
);

/// A norm whose residual add a fused op takes in: `add(x, r)` then `norm(sum, rest…)` becomes
/// `fused(x, r, rest…, rounding)`, whose results are the norm's output and the sum.
pub(crate) struct AddNorm {
    /// The norm (`x` first).
    pub(crate) norm: &'static OpDef,
    /// The fused op: `x`, `x_residual`, the norm's parameters after `x`, then `rounding`.
    pub(crate) fused: &'static OpDef,
    /// The fused op's `rounding` parameter.
    pub(crate) rounding: usize,
    /// Whether the fused op gives the pair's bits on a provider that runs both.
    pub(crate) bit_exact_on: fn(provider: &str) -> bool,
}

/// Whether a provider's row-program ops give the bits of its unfused kernels: the cpu's (its
/// row-program interpreter sums in the cpu norms' lanes and computes silu as its gated kernel,
/// tested bit for bit) and the reference's. A GPU's generated kernels give its unfused kernels'
/// bits only where a chain proves it (the sandwich on CUDA and HIP): the hand-written gated kernels
/// compute silu with other instructions, add + LayerNorm is not proven, and an OpenCL kernel
/// reduces by another tree.
pub(crate) fn reduces_like_its_norms(provider: &str) -> bool {
    matches!(provider, "cpu" | "native")
}

/// Add + `rms_norm`.
pub(crate) const ADD_RMS_NORM: AddNorm = AddNorm {
    norm: &RMS_NORM,
    fused: &FUSED_ADD_RMS_NORM,
    rounding: FusedAddRmsNormArgs::rounding,
    // Every provider's `rms_norm` and `fused_add_rms_norm` kernels are written as a pair (one row
    // loop, one reduction).
    bit_exact_on: |_| true,
};

/// Add + `layer_norm`.
pub(crate) const ADD_LAYER_NORM: AddNorm = AddNorm {
    norm: &LAYER_NORM,
    fused: &FUSED_ADD_LAYER_NORM,
    rounding: FusedAddLayerNormArgs::rounding,
    bit_exact_on: reduces_like_its_norms,
};

use crate::analysis::{DecidedFusion, FusedCall, FusionSite, apply_fusions, split_misplaced};
use crate::{FusionReport, FusionSkip, PassContext, PassError};

/// One fusion decided on the unmodified graph.
struct Fusion {
    add: NodeId,
    norm: NodeId,
    /// The node the fused call goes right before: the norm, or the add when the sum is read first.
    anchor: NodeId,
    /// The fused call's arguments: the add's two operands, then the norm's remaining arguments.
    args: Vec<Arg>,
    /// The norm's output and the sum, which the fused call's results replace.
    replaced: [ValueId; 2],
    /// The norm's statement, printed (for the report, should a later check keep the pair).
    statement: String,
}

impl DecidedFusion for Fusion {
    fn site(&self) -> FusionSite<'_> {
        FusionSite {
            anchor: self.anchor,
            args: &self.args,
            removed: [self.add, self.norm].into_iter().collect(),
            replaced: &self.replaced,
        }
    }
}

/// Add + RMSNorm fusion: a residual add whose sum an `rms_norm` normalizes becomes one
/// `fused_add_rms_norm` call, whose second result is the sum. Later readers of the sum read that
/// result, so the residual stream stays available; lowering then picks the fused kernel, which
/// writes both results into its activations in place where the donations allow.
///
/// ```text
/// %s = add(%x, %r) : bf16[8,16]                      %o, %s2 = fused_add_rms_norm(%x, %r, %w, 1e-6, none)
/// %o = rms_norm(%s, %w, 1e-6, none) : bf16[8,16]  →          : bf16[8,16], bf16[8,16]
/// output(%o, %s)                                     output(%o, %s2)
/// ```
///
/// # When a candidate is fused
///
/// Every functional `rms_norm` whose input is the result of an `add` is a candidate. It is fused
/// when all of these hold, and otherwise reported with the first that fails:
///
/// - **A place for the fused call** ([`FusionSkip::SumReadBeforeNorm`]): it takes the norm's place
///   when nothing reads the sum before the norm, else the add's place when the norm's other operands
///   (its weight) are defined before the add; otherwise the pair stays.
///   ```text
///   %s = add(%x, %r) : f32[2,8]
///   %w2 = scale(%w, 2.0) : f32[8]           // the weight is made after the add,
///   %t = scale(%s, 2.0) : f32[2,8]          // and the sum is read before the norm: kept as is
///   %o = rms_norm(%s, %w2, 1e-6, none) : f32[2,8]
///   ```
/// - **Nothing is written between them** ([`FusionSkip::WriteBetween { first: "add", second: "norm" }`]): the add moves to the
///   norm's place (or the norm to the add's), so a write in between (`copy_`, an in-place `impl`
///   call) could change what it reads.
///   ```text
///   %s = add(%x, %r) : f32[2,8]
///   %c = copy_(%x, %y) : f32[2,8]           // writes %x, which the add reads: kept as is
///   %o = rms_norm(%s, none, 1e-6, none) : f32[2,8]
///   ```
/// - **One norm per add** ([`FusionSkip::AddAlreadyFused`]): when two norms read one sum, the first
///   fuses and the second reads the fused call's residual result, so the sum is computed once.
/// - **Every operand is there where the fused call stands** ([`FusionSkip::OperandNotReady`]): the
///   call reads no value the pair computes or that depends on it, and none defined after its place,
///   counting a value another fusion replaces as defined where that fusion's call stands (checked
///   once every pair is decided, dropping pairs until all that remain fit).
///   ```text
///   %s = add(%x, %r) : f32[8]
///   %o = rms_norm(%s, %s, 1e-6, none) : f32[8]  // the weight is the sum: kept as is
///   ```
/// - **The fused op gives the same metadata** ([`FusionSkip::Metadata`]): its two results must have
///   the dtype, device and layout of the norm's output and of the sum (the add of two strided
///   views, for instance, gives a compact sum, and so does the fused residual output; mixed dtypes
///   do not fuse).
///
/// # Rounding
///
/// `fused_add_rms_norm` normalizes the sum before rounding it to the dtype by default (`rounding =
/// "exact"`), where the unfused pair normalizes the rounded sum. For f32 and f64 the two agree bit
/// for bit (the sum is computed in the dtype itself); for f16 and bf16 the fused result may differ
/// in the last bit of some elements, within the ops' tolerance, and `rounding = "dtype"` makes the
/// fused op normalize the rounded sum, as the pair does. The residual output (the sum) is
/// bit-identical for every dtype. The standard pipeline, which promises bit-identical results,
/// therefore runs `fuse-add-rms-norm-exact` ([`fuse_add_rms_norm_exact`]), which fuses every pair
/// whose norm runs on the provider the fused op would run on, the f16 and bf16 ones with `rounding
/// = "dtype"`, and reports the others ([`FusionSkip::Provider`]: another provider may sum the
/// squares in another order); `fuse-add-rms-norm` by name fuses every pair with the default
/// rounding (`vllm-ir opt --passes functionalize,fuse-add-rms-norm,…`), within the ops' tolerance.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, fuse_add_rms_norm};
///
/// let mut graph = parse(
///     "graph g(%x: f32[2,8], %r: f32[2,8], %w: f32[8]) {
///        %s = add(%x, %r) : f32[2,8]
///        %o = rms_norm(%s, %w, 1e-6, none) : f32[2,8]
///        output(%o, %s)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = fuse_add_rms_norm(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.fused.len(), 1);
/// assert!(graph.to_string().contains("= fused_add_rms_norm(%x, %r, %w, 1e-6, none) : f32[2,8], f32[2,8]"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Fuses every add + rms_norm pair the rules above allow.
///
/// Linear: one pass decides every fusion on the unmodified graph (positions, use lists and a prefix
/// count of writing nodes answer each rule in constant time per use), one more rewrites the uses.
pub fn fuse_add_rms_norm(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FusionReport, PassError> {
    let _span = tracing::info_span!("pass", name = "fuse-add-rms-norm").entered();
    let mut report = FusionReport::new("add + rms_norm");
    fuse_add_norm(graph, cx, &ADD_RMS_NORM, false, &mut report)?;
    Ok(report)
}

/// `fuse-add-rms-norm-exact`, the standard pipeline's form: fuses the pairs whose results stay
/// bit-identical (every dtype: f16 and bf16 pairs with `rounding = "dtype"`, the norm of the
/// rounded sum) when the norm and the fused op run on one provider, and reports the others.
pub fn fuse_add_rms_norm_exact(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FusionReport, PassError> {
    let _span = tracing::info_span!("pass", name = "fuse-add-rms-norm-exact").entered();
    let mut report = FusionReport::new("add + rms_norm");
    fuse_add_norm(graph, cx, &ADD_RMS_NORM, true, &mut report)?;
    Ok(report)
}

/// Fuses every add + norm pair of `pattern` the rules of [`fuse_add_rms_norm`] allow (with `exact`,
/// those of [`fuse_add_rms_norm_exact`]), adding what it fused and kept to `report`.
pub(crate) fn fuse_add_norm(
    graph: &mut Graph,
    cx: &PassContext<'_>,
    pattern: &AddNorm,
    exact: bool,
    report: &mut FusionReport,
) -> Result<(), PassError> {
    let fused_def = cx
        .registry
        .op_def(pattern.fused.name)
        .ok_or_else(|| PassError::UnknownOp { op: pattern.fused.name.to_owned() })?;
    // The analyses below read the whole graph: a graph without a candidate pair (most) skips them.
    if !graph.mentions_op(pattern.norm) || !graph.order().iter().any(|&norm| candidate(graph, pattern, norm).is_some())
    {
        return Ok(());
    }
    let FusionFacts { positions, uses, writes_before } = FusionFacts::compute(graph, cx);

    let mut fusions = Vec::new();
    let mut fused_adds = EntitySet::new();
    for &norm in graph.order() {
        let Some((args, sum, add, add_args)) = candidate(graph, pattern, norm) else { continue };
        let (Some(&x), Some(&r)) = (add_args[0].value(), add_args[1].value()) else { continue };
        let (add_at, norm_at) = (positions[add] as usize, positions[norm] as usize);
        let statement = graph.display_node(norm);
        if fused_adds.contains(add) {
            report.skipped.push((statement, FusionSkip::AddAlreadyFused));
            continue;
        }
        let dtype = graph.meta(*sum).dtype;
        let read_before_norm = uses[*sum].iter().any(|&user| user != norm && (positions[user] as usize) < norm_at);
        let anchor = if !read_before_norm {
            norm
        } else if args[1..].iter().all(|arg| match arg {
            Arg::Tensor(v) => (positions[graph.value(*v).def] as usize) < add_at,
            _ => true,
        }) {
            add
        } else {
            report.skipped.push((statement, FusionSkip::SumReadBeforeNorm));
            continue;
        };
        if writes_before[norm_at] - writes_before[add_at + 1] > 0 {
            report.skipped.push((statement, FusionSkip::WriteBetween { first: "add", second: "norm" }));
            continue;
        }
        let mut fused_args = vec![Arg::Tensor(x), Arg::Tensor(r)];
        fused_args.extend(args[1..].iter().cloned());
        // The exact form normalizes the sum rounded to the dtype, as the pair does (the same for
        // f32 and f64, whose sum is computed in the dtype itself).
        if exact && !matches!(dtype, ir_core::DType::F32 | ir_core::DType::F64) {
            fused_args.resize(pattern.rounding, Arg::None);
            fused_args.push(Arg::Str(ir_ops::Rounding::Dtype.as_str().to_owned()));
        }
        let output = graph.node(norm).results[0];
        let expected = [graph.meta(output), graph.meta(*sum)];
        if let Err(why) = same_metadata(graph, fused_def, &fused_args, ["output", "residual"], expected) {
            report.skipped.push((statement, FusionSkip::Metadata(why)));
            continue;
        }
        if exact && let Some(reason) = provider_change(graph, cx, pattern, args, &fused_args) {
            report.skipped.push((statement, reason));
            continue;
        }
        fused_adds.insert(add);
        fusions.push(Fusion { add, norm, anchor, args: fused_args, replaced: [output, *sum], statement });
    }
    let (fusions, dropped) = split_misplaced(graph, &positions, fusions);
    for (fusion, operand) in dropped {
        report.skipped.push((fusion.statement, FusionSkip::OperandNotReady { operand }));
    }
    let decided = fusions
        .into_iter()
        .map(|fusion| FusedCall {
            op: pattern.fused.name,
            anchor: fusion.anchor,
            args: fusion.args,
            removed: [fusion.add, fusion.norm].into_iter().collect(),
            replaced: fusion.replaced.to_vec(),
        })
        .collect();
    let created = apply_fusions(graph, decided);
    report.fused.extend(created.iter().map(|&node| graph.display_node(node)));
    tracing::debug!(target: "ir_passes::fuse_add_rms_norm", %report, "fused");
    Ok(())
}

/// A functional call of the pattern's norm whose input is the result of an `add`: its arguments,
/// the sum, the add node and the add's arguments.
fn candidate<'g>(
    graph: &'g Graph,
    pattern: &AddNorm,
    norm: NodeId,
) -> Option<(&'g [Arg], &'g ValueId, NodeId, &'g [ir_graph::BuiltinArg])> {
    let args = graph.functional_call_of(norm, pattern.norm)?;
    let Some(Arg::Tensor(sum)) = args.first() else { return None };
    let (add, add_args) = graph.builtin_defining(*sum, Builtin::Add)?;
    Some((args, sum, add, add_args))
}

/// Why the exact form keeps a pair: the providers the installed priorities pick for the norm and
/// for the fused op differ (or one cannot be selected), or their one provider's fused kernel does
/// not give the pair's bits; `None` when the fused call keeps them.
fn provider_change(
    graph: &Graph,
    cx: &PassContext<'_>,
    pattern: &AddNorm,
    norm_args: &[Arg],
    fused_args: &[Arg],
) -> Option<FusionSkip> {
    match (select(graph, cx, pattern.norm, norm_args), select(graph, cx, pattern.fused, fused_args)) {
        (Ok(norm), Ok(fused)) if norm == fused && (pattern.bit_exact_on)(&fused) => None,
        (Ok(norm), Ok(fused)) if norm == fused => Some(FusionSkip::NotBitExact { provider: fused }),
        (Ok(norm), Ok(fused)) => Some(FusionSkip::Provider { norm, fused }),
        (Err(why), _) | (_, Err(why)) => Some(FusionSkip::Metadata(why)),
    }
}

/// The provider the installed priorities pick for a call of `def` with `args`, or why none.
pub(crate) fn select(graph: &Graph, cx: &PassContext<'_>, def: &OpDef, args: &[Arg]) -> Result<String, String> {
    let metas: Vec<_> = args.iter().map(|arg| graph.arg_meta(arg)).collect();
    cx.registry.select(def.name, &metas).map(|s| s.provider.to_owned()).map_err(|e| e.to_string())
}

/// Whether the fused op, bound to `args`, gives exactly `expected` (its two results in order, named
/// `names` in the answer), or how they differ.
pub(crate) fn same_metadata(
    graph: &Graph,
    def: &'static OpDef,
    args: &[Arg],
    names: [&str; 2],
    expected: [&TensorMeta; 2],
) -> Result<(), String> {
    let metas = args.iter().map(|arg| graph.arg_meta(arg)).collect();
    let outputs = def.output_metas(metas).map_err(|e| e.to_string())?;
    for ((what, got), want) in names.iter().zip(&outputs).zip(expected) {
        if got != want {
            return Err(format!("its {what} would be {got}, not {want}"));
        }
    }
    Ok(())
}
