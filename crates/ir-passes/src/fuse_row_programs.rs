//! The `fuse_row_programs` pass ([`fuse_row_programs`] documents it).

use crate::analysis::FusionFacts;
use ir_core::DType;
use ir_core::op::{ArgMeta, OpDef};
use ir_graph::{Arg, Graph, NodeId, ValueId};
use ir_ops::dynamic_per_token_scaled_fp8_quant::{
    DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT, DynamicPerTokenScaledFp8QuantArgs,
};
use ir_ops::fused_add_rms_norm::{FUSED_ADD_RMS_NORM, FusedAddRmsNormArgs};
use ir_ops::fused_qk_norm_rope::{FUSED_QK_NORM_ROPE, FusedQkNormRopeArgs};
use ir_ops::fused_sandwich_rms_norm::{FUSED_SANDWICH_RMS_NORM, FusedSandwichRmsNormArgs};
use ir_ops::rms_norm::{RMS_NORM, RmsNormArgs};
use ir_ops::rotary_embedding::{ROTARY_EMBEDDING, RotaryEmbeddingArgs};
use ir_ops::silu_and_mul::SILU_AND_MUL;
use ir_ops::silu_and_mul_dynamic_fp8_quant::{SILU_AND_MUL_DYNAMIC_FP8_QUANT, SiluAndMulDynamicFp8QuantArgs};

use crate::analysis::{DecidedFusion, FusedCall, FusionSite, apply_fusions, split_misplaced};
use crate::fuse_add_rms_norm::{ADD_LAYER_NORM, fuse_add_norm, reduces_like_its_norms, same_metadata, select};
use crate::{FusionReport, FusionSkip, PassContext, PassError};

// The sandwich takes the first norm's `x` and weight, the fused add's residual and weight, one
// epsilon and the fused add's rounding; the fused silu + quantization takes `silu_and_mul`'s `x`
// and the quantization's arguments after its input, in order.
const _: () = assert!(
    FusedSandwichRmsNormArgs::x == 0
        && FusedSandwichRmsNormArgs::x_residual == 1
        && FusedSandwichRmsNormArgs::post_weight == 2
        && FusedSandwichRmsNormArgs::pre_weight == 3
        && FusedSandwichRmsNormArgs::epsilon == 4
        && FusedSandwichRmsNormArgs::rounding == 5
        && SiluAndMulDynamicFp8QuantArgs::x == 0
        && SiluAndMulDynamicFp8QuantArgs::scale_ub == DynamicPerTokenScaledFp8QuantArgs::scale_ub
        && SiluAndMulDynamicFp8QuantArgs::out_dtype == DynamicPerTokenScaledFp8QuantArgs::out_dtype
        && DynamicPerTokenScaledFp8QuantArgs::x == 0
);

// The head norms + rotation take the rotation's arguments with the two weights after the key and
// the norms' epsilon after the cache.
const _: () = assert!(
    FusedQkNormRopeArgs::positions == RotaryEmbeddingArgs::positions
        && FusedQkNormRopeArgs::query == RotaryEmbeddingArgs::query
        && FusedQkNormRopeArgs::key == RotaryEmbeddingArgs::key
        && FusedQkNormRopeArgs::q_weight == 3
        && FusedQkNormRopeArgs::k_weight == 4
        && FusedQkNormRopeArgs::cos_sin_cache == 5
        && RotaryEmbeddingArgs::cos_sin_cache == 3
        && FusedQkNormRopeArgs::epsilon == 6
        && FusedQkNormRopeArgs::head_size == 7
        && RotaryEmbeddingArgs::head_size == 4
        && FusedQkNormRopeArgs::rounding == 10
        && RotaryEmbeddingArgs::rounding == 7
);

/// The fused call's arguments from a chain's two calls' arguments, or why the chain stays.
type ChainArgs = fn(first: &[Arg], second: &[Arg]) -> Result<Vec<Arg>, FusionSkip>;

/// Two calls, the second reading the first's output as its `x`, that one fused op computes.
struct Chain {
    first: &'static OpDef,
    second: &'static OpDef,
    fused: &'static OpDef,
    /// The fused call's arguments.
    args: ChainArgs,
    /// The names of the fused op's two results (for a metadata refusal).
    results: [&'static str; 2],
    /// Whether the fused op gives the chain's bits on a provider that runs all three calls.
    bit_exact_on: BitExactOn,
}

/// Whether a fused op gives its chain's bits on `provider`, called on tensors of `dtypes`.
type BitExactOn = fn(provider: &str, dtypes: &[DType]) -> bool;

/// The chains with a fused op.
static CHAINS: [Chain; 2] = [
    Chain {
        first: &RMS_NORM,
        second: &FUSED_ADD_RMS_NORM,
        fused: &FUSED_SANDWICH_RMS_NORM,
        args: sandwich_args,
        results: ["output", "residual"],
        bit_exact_on: sandwich_bit_exact_on,
    },
    Chain {
        first: &SILU_AND_MUL,
        second: &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT,
        fused: &SILU_AND_MUL_DYNAMIC_FP8_QUANT,
        args: |first, second| Ok(first[..1].iter().chain(&second[1..]).cloned().collect()),
        results: ["codes", "scales"],
        // A provider's fused kernel computes silu from the program's steps, its `silu_and_mul`
        // kernel its own way: the cpu's both as `g / (1 + exp(-g))` with one vectorized `exp`
        // (tested bit for bit in `kernels-cpu`), a GPU's with other instructions.
        bit_exact_on: |provider, _| reduces_like_its_norms(provider),
    },
];

/// Whether a provider's `fused_sandwich_rms_norm` gives its `rms_norm` then `fused_add_rms_norm`
/// bits: where its row programs reduce like its norms, and on CUDA and HIP (the devices and the
/// emulated ones, wavefronts of 64 and 32) for f32, f16 and bf16 tensors: the generated kernel owns
/// and reduces a row's chunks as the hand-written norms do, sums an overflowing row again in
/// double as they do, and rounds every product and sum on its own as they do (tested bit for bit
/// on every emulated GPU, and for fused multiply-adds in the PTX). f64, a reference dtype, is not
/// proven: HIP's norms mixing it with another dtype run at other threads per row.
fn sandwich_bit_exact_on(provider: &str, dtypes: &[DType]) -> bool {
    const GPUS: [&str; 5] = ["cuda", "emu_cuda", "rocm", "emu_hip", "emu_hip_wave32"];
    reduces_like_its_norms(provider) || (GPUS.contains(&provider) && !dtypes.contains(&DType::F64))
}

/// `rms_norm(x, post_weight, epsilon, none)` then `fused_add_rms_norm(h, r, pre_weight, epsilon,
/// none, rounding)`: `fused_sandwich_rms_norm(x, r, post_weight, pre_weight, epsilon, rounding)`.
fn sandwich_args(norm: &[Arg], add_norm: &[Arg]) -> Result<Vec<Arg>, FusionSkip> {
    let absent = |args: &[Arg], at: usize| matches!(args.get(at), None | Some(Arg::None));
    if !absent(norm, RmsNormArgs::variance_size) || !absent(add_norm, FusedAddRmsNormArgs::variance_size) {
        return Err(FusionSkip::VarianceSize);
    }
    let epsilon = |args: &[Arg], at: usize| match args.get(at) {
        Some(Arg::F64(e)) => Some(e.to_bits()),
        _ => None,
    };
    let eps = epsilon(norm, RmsNormArgs::epsilon);
    if eps.is_none() || eps != epsilon(add_norm, FusedAddRmsNormArgs::epsilon) {
        return Err(FusionSkip::EpsilonDiffers);
    }
    let arg = |args: &[Arg], at: usize| args.get(at).cloned().unwrap_or(Arg::None);
    let mut args = vec![
        arg(norm, RmsNormArgs::x),
        arg(add_norm, FusedAddRmsNormArgs::x_residual),
        arg(norm, RmsNormArgs::weight),
        arg(add_norm, FusedAddRmsNormArgs::weight),
        arg(norm, RmsNormArgs::epsilon),
    ];
    if let Some(rounding) = add_norm.get(FusedAddRmsNormArgs::rounding) {
        args.push(rounding.clone());
    }
    Ok(args)
}

/// One chain fusion decided on the unmodified graph.
struct Fusion {
    chain: &'static Chain,
    first: NodeId,
    second: NodeId,
    args: Vec<Arg>,
    /// The second call's results, which the fused call's replace.
    replaced: Vec<ValueId>,
    /// The second call's statement, printed.
    statement: String,
}

impl DecidedFusion for Fusion {
    fn site(&self) -> FusionSite<'_> {
        FusionSite {
            anchor: self.second,
            args: &self.args,
            removed: [self.first, self.second].into_iter().collect(),
            replaced: &self.replaced,
        }
    }
}

/// Row-program fusion: chains of calls that one generated row-program op computes become that op,
/// so the values between them are never written to memory. Each fused op is declared once and
/// implemented on every provider by the kernel generated from its row program (no kernel written
/// for it by hand); the chains are the model patterns engines run:
///
/// | chain | fused op (results) | models |
/// |---|---|---|
/// | `add` then `layer_norm` | `fused_add_layer_norm` (`out`, `residual_out`) | LayerNorm models |
/// | `rms_norm` then `fused_add_rms_norm` of its output | `fused_sandwich_rms_norm` (`out`, `residual_out`) | Gemma 2 and 3 |
/// | `silu_and_mul` then `dynamic_per_token_scaled_fp8_quant` of its output | `silu_and_mul_dynamic_fp8_quant` (`q`, `scales`) | fp8 feed-forward blocks |
/// | `rms_norm` of the heads of query and of key, then `rotary_embedding` of both | `fused_qk_norm_rope` (`query`, `key`) | Qwen3 |
///
/// The heads are the query and key viewed `[tokens, heads, head_size]` (a `reshape` each way):
///
/// ```text
/// %qh = reshape(%q, [4,2,8]) : bf16[4,2,8]
/// %qn = rms_norm(%qh, %wq, 1e-6, none) : bf16[4,2,8]
/// %q2 = reshape(%qn, [4,16]) : bf16[4,16]
/// ... the same for %k ...
/// %rq, %rk = rotary_embedding(%pos, %q2, %k2, %cache, 8, 8, true, "exact")
///   →  %rq, %rk = fused_qk_norm_rope(%pos, %q, %k, %wq, %wk, %cache, 1e-6, 8, 8, true, "exact")
/// ```
///
/// ```text
/// %h = rms_norm(%a, %w1, 1e-6, none) : bf16[8,16]                %o, %s = fused_sandwich_rms_norm(%a, %r, %w1, %w2, 1e-6, dtype)
/// %o, %s = fused_add_rms_norm(%h, %r, %w2, 1e-6, none, dtype)  →        : bf16[8,16], bf16[8,16]
///          : bf16[8,16], bf16[8,16]
/// ```
///
/// A Gemma sandwich is found in the form `fuse-add-rms-norm` leaves it (its add and second norm
/// already one `fused_add_rms_norm`), which is why the standard pipeline runs
/// `fuse-add-rms-norm-exact` first. The pass matches functional calls only (`functionalize` runs
/// first in the standard pipeline).
///
/// # When a candidate is fused
///
/// Add + `layer_norm` follows the rules of [`fuse_add_rms_norm`](crate::fuse_add_rms_norm) (a
/// place for the fused call, nothing written between, one norm per add, every operand ready, the
/// same metadata; the exact form rounds a 16-bit sum as the pair does). A two-call chain is fused
/// when all of these hold, and otherwise reported with the first that fails ([`FusionSkip`]):
///
/// - **The intermediate value has no other reader** ([`FusionSkip::IntermediateRead`]): the
///   second call is the only reader of the first's output (a graph output needs it in memory),
///   and reads it only as its input.
///   ```text
///   %h = silu_and_mul(%x) : bf16[4,8]
///   %q, %sc = dynamic_per_token_scaled_fp8_quant(%h, none, f8e4m3fn) : f8e4m3fn[4,8], f32[4,1]
///   output(%q, %sc, %h)                    // h is an output: kept as is
///   ```
/// - **The arguments fit the fused op**: the norms have no `variance_size`
///   ([`FusionSkip::VarianceSize`]) and one epsilon ([`FusionSkip::EpsilonDiffers`]).
/// - **Nothing is written between them** ([`FusionSkip::WriteBetween`]): the first call moves to
///   the second's place, so a write in between could change what it reads.
/// - **Every operand is there where the fused call stands** ([`FusionSkip::OperandNotReady`]), as
///   for the other fusions.
/// - **The fused op gives the same metadata** ([`FusionSkip::Metadata`]): the dtype, device and
///   layout of the second call's results (a residual of another dtype than x does not fuse into
///   the sandwich, which takes one).
///
/// # Rounding and providers
///
/// Each fused op's semantics are its chain's, rounding points included (the first call's output
/// rounded to its dtype, the sum rounded as the fused add's `rounding` says), so the pass changes
/// no result of the reference. Kernels may differ: the standard pipeline runs
/// `fuse-row-programs-exact` ([`fuse_row_programs_exact`]), which fuses a chain only when the
/// installed priorities pick the fused op's provider for every call of the chain
/// ([`FusionSkip::ProviderDiffers`]) and that provider gives the chain's bits
/// ([`FusionSkip::NotBitExact`]): the cpu provider and `native`. The cpu's row-program
/// interpreter reduces a row in the lanes of its norms and computes silu as its `silu_and_mul`
/// kernel does (`g / (1 + exp(-g))` with one vectorized `exp`), both tested bit for bit. A GPU
/// provider's generated kernel may assign a row's elements to its threads otherwise than its
/// hand-written norms do, which changes the last bits of an f32 norm, and computes silu with other
/// instructions than its gated kernel. `fuse-row-programs` by name fuses every chain, within the
/// fused ops' tolerance.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, fuse_row_programs};
///
/// let mut graph = parse(
///     "graph g(%x: f32[2,8], %r: f32[2,8], %w: f32[8], %b: f32[8]) {
///        %s = add(%x, %r) : f32[2,8]
///        %o = layer_norm(%s, %w, %b, 1e-5) : f32[2,8]
///        output(%o, %s)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = fuse_row_programs(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.fused.len(), 1);
/// assert!(graph.to_string().contains("= fused_add_layer_norm(%x, %r, %w, %b, 1e-5) : f32[2,8], f32[2,8]"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Linear: each family is decided in one walk over the unmodified graph and applied in one more.
pub fn fuse_row_programs(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FusionReport, PassError> {
    let _span = tracing::info_span!("pass", name = "fuse-row-programs").entered();
    fuse(graph, cx, false)
}

/// `fuse-row-programs-exact`, the standard pipeline's form: fuses the chains whose results stay
/// bit-identical (16-bit add + `layer_norm` pairs with `rounding = "dtype"`; every call on the
/// fused op's provider, one that gives the chain's bits) and reports the others.
pub fn fuse_row_programs_exact(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FusionReport, PassError> {
    let _span = tracing::info_span!("pass", name = "fuse-row-programs-exact").entered();
    fuse(graph, cx, true)
}

fn fuse(graph: &mut Graph, cx: &PassContext<'_>, exact: bool) -> Result<FusionReport, PassError> {
    let mut report = FusionReport::new("row-program");
    // Every fused op is looked up before anything changes: on error the graph is as it was.
    let fused_ops =
        [ADD_LAYER_NORM.fused, &FUSED_QK_NORM_ROPE].into_iter().chain(CHAINS.iter().map(|chain| chain.fused));
    for def in fused_ops {
        if cx.registry.op_def(def.name).is_none() {
            return Err(PassError::UnknownOp { op: def.name.to_owned() });
        }
    }
    fuse_add_norm(graph, cx, &ADD_LAYER_NORM, exact, &mut report)?;
    fuse_chains(graph, cx, exact, &mut report)?;
    fuse_qk_norm_rope(graph, cx, exact, &mut report)?;
    tracing::debug!(target: "ir_passes::fuse_row_programs", %report, "fused");
    Ok(report)
}

fn fuse_chains(
    graph: &mut Graph,
    cx: &PassContext<'_>,
    exact: bool,
    report: &mut FusionReport,
) -> Result<(), PassError> {
    // The analyses below read the whole graph: a graph that calls no chain's second op skips them.
    if !CHAINS.iter().any(|chain| graph.mentions_op(chain.first) && graph.mentions_op(chain.second)) {
        return Ok(());
    }
    let FusionFacts { positions, uses, writes_before } = FusionFacts::compute(graph, cx);

    let mut fusions = Vec::new();
    for &second in graph.order() {
        let Some((chain, second_args)) =
            CHAINS.iter().find_map(|chain| graph.functional_call_of(second, chain.second).map(|args| (chain, args)))
        else {
            continue;
        };
        let Some(&Arg::Tensor(intermediate)) = second_args.first() else { continue };
        let first = graph.value(intermediate).def;
        let Some(first_args) = graph.functional_call_of(first, chain.first) else { continue };
        if graph.node(first).results.first() != Some(&intermediate) {
            continue;
        }
        let statement = graph.display_node(second);
        let skip = |reason| (statement.clone(), reason);
        let read_elsewhere = uses[intermediate].iter().any(|&user| user != second)
            || second_args[1..].iter().any(|arg| matches!(arg, Arg::Tensor(v) if *v == intermediate));
        if read_elsewhere {
            report.skipped.push(skip(FusionSkip::IntermediateRead { op: chain.first.name }));
            continue;
        }
        let args = match (chain.args)(first_args, second_args) {
            Ok(args) => args,
            Err(reason) => {
                report.skipped.push(skip(reason));
                continue;
            }
        };
        let (first_at, second_at) = (positions[first] as usize, positions[second] as usize);
        if writes_before[second_at] - writes_before[first_at + 1] > 0 {
            report.skipped.push(skip(FusionSkip::WriteBetween { first: chain.first.name, second: chain.second.name }));
            continue;
        }
        let replaced = graph.node(second).results.to_vec();
        let [a, b] = replaced[..] else { continue };
        if let Err(why) = same_metadata(graph, chain.fused, &args, chain.results, [graph.meta(a), graph.meta(b)]) {
            report.skipped.push(skip(FusionSkip::Metadata(why)));
            continue;
        }
        if exact && let Some(reason) = not_exact(graph, cx, chain, [first_args, second_args], &args) {
            report.skipped.push(skip(reason));
            continue;
        }
        fusions.push(Fusion { chain, first, second, args, replaced, statement });
    }
    apply_decided(graph, &positions, fusions, report, |fusion| {
        let call = FusedCall {
            op: fusion.chain.fused.name,
            anchor: fusion.second,
            args: fusion.args,
            removed: [fusion.first, fusion.second].into_iter().collect(),
            replaced: fusion.replaced,
        };
        (fusion.statement, call)
    });
    Ok(())
}

/// Applies the decided fusions whose operands are ready where their calls stand and reports them;
/// reports the others (`parts` gives a fusion's statement and its call).
fn apply_decided<F: DecidedFusion>(
    graph: &mut Graph,
    positions: &cranelift_entity::SecondaryMap<NodeId, u32>,
    fusions: Vec<F>,
    report: &mut FusionReport,
    parts: impl Fn(F) -> (String, FusedCall),
) {
    let (fusions, dropped) = split_misplaced(graph, positions, fusions);
    for (fusion, operand) in dropped {
        report.skipped.push((parts(fusion).0, FusionSkip::OperandNotReady { operand }));
    }
    let created = apply_fusions(graph, fusions.into_iter().map(|fusion| parts(fusion).1).collect());
    report.fused.extend(created.iter().map(|&node| graph.display_node(node)));
}

/// Why the exact form keeps a chain: a call of it runs on another provider than the fused op
/// would, or that provider's fused kernel does not give the chain's bits; `None` when it does.
fn not_exact(
    graph: &Graph,
    cx: &PassContext<'_>,
    chain: &Chain,
    calls: [&[Arg]; 2],
    fused_args: &[Arg],
) -> Option<FusionSkip> {
    let calls = [(chain.first, calls[0]), (chain.second, calls[1])];
    not_exact_calls(graph, cx, chain.fused, chain.bit_exact_on, &calls, fused_args)
}

/// Why the exact form keeps a chain of `calls` that `fused` (called with `fused_args`) computes: a
/// call runs on another provider than the fused op would, or that provider's fused kernel does not
/// give the chain's bits (`bit_exact_on`); `None` when the chain may fuse.
fn not_exact_calls(
    graph: &Graph,
    cx: &PassContext<'_>,
    fused: &'static OpDef,
    bit_exact_on: BitExactOn,
    calls: &[(&'static OpDef, &[Arg])],
    fused_args: &[Arg],
) -> Option<FusionSkip> {
    let provider = match select(graph, cx, fused, fused_args) {
        Ok(provider) => provider,
        Err(why) => return Some(FusionSkip::Metadata(why)),
    };
    for &(def, args) in calls {
        match select(graph, cx, def, args) {
            Ok(p) if p == provider => {}
            Ok(p) => return Some(FusionSkip::ProviderDiffers { op: def.name, provider: p, fused: provider }),
            Err(why) => return Some(FusionSkip::Metadata(why)),
        }
    }
    let dtypes: Vec<DType> = fused_args
        .iter()
        .filter_map(|arg| match graph.arg_meta(arg) {
            ArgMeta::Tensor(meta) => Some(meta.dtype),
            _ => None,
        })
        .collect();
    (!bit_exact_on(&provider, &dtypes)).then_some(FusionSkip::NotBitExact { provider })
}

/// One tensor's head norm feeding a rotation: `reshape(rms_norm(reshape(x, [t, n, d]), w, eps),
/// shape of x)`.
struct HeadNorm {
    /// The tensor whose heads are normalized.
    x: ValueId,
    weight: Arg,
    epsilon: Arg,
    /// The norm and the view back.
    nodes: [NodeId; 2],
}

/// The head norm that defines `value` (a rotation's query or key), read by `reader` alone, with a
/// weight and no `variance_size`; `None` when `value` is not one.
fn head_norm(
    graph: &Graph,
    uses: &cranelift_entity::SecondaryMap<ValueId, ir_graph::UseList>,
    value: ValueId,
    reader: NodeId,
    head_size: i64,
) -> Option<HeadNorm> {
    let view = |node: NodeId| match &graph.node(node).kind {
        ir_graph::NodeKind::Builtin { op: ir_core::builtin::Builtin::Reshape, args } => match args.as_slice() {
            [ir_core::builtin::BuiltinArg::Value(of), ir_core::builtin::BuiltinArg::Shape(shape)] => Some((*of, shape)),
            _ => None,
        },
        _ => None,
    };
    let only_reader = |v: ValueId, node: NodeId| uses[v].iter().all(|&user| user == node);
    let back = graph.value(value).def;
    let (normed, _) = view(back)?;
    let norm = graph.value(normed).def;
    let args = graph.functional_call_of(norm, &RMS_NORM)?;
    let &Arg::Tensor(heads) = args.get(RmsNormArgs::x)? else { return None };
    let (x, shape) = view(graph.value(heads).def)?;
    let absent = |at: usize| matches!(args.get(at), None | Some(Arg::None));
    let fits = graph.node(norm).results.first() == Some(&normed)
        && only_reader(normed, back)
        && only_reader(value, reader)
        && shape.len() == 3
        && i64::try_from(shape[2]).ok() == Some(head_size)
        && graph.meta(x).shape() == graph.meta(value).shape()
        && matches!(args.get(RmsNormArgs::weight), Some(Arg::Tensor(_)))
        && absent(RmsNormArgs::variance_size);
    fits.then(|| HeadNorm {
        x,
        weight: args[RmsNormArgs::weight].clone(),
        epsilon: args.get(RmsNormArgs::epsilon).cloned().unwrap_or(Arg::None),
        nodes: [norm, back],
    })
}

/// One head norms + rotation fusion decided on the unmodified graph.
struct QkFusion {
    rotary: NodeId,
    args: Vec<Arg>,
    removed: smallvec::SmallVec<[NodeId; 3]>,
    replaced: Vec<ValueId>,
    statement: String,
}

impl DecidedFusion for QkFusion {
    fn site(&self) -> FusionSite<'_> {
        FusionSite { anchor: self.rotary, args: &self.args, removed: self.removed.clone(), replaced: &self.replaced }
    }
}

/// Qwen3's head norms then rotation ([`fuse_row_programs`]'s last chain): a functional
/// `rotary_embedding` whose query and key are each the head norm of a tensor, read by the rotation
/// alone, becomes `fused_qk_norm_rope` of those tensors, under the rules of the two-call chains
/// (one epsilon, nothing written between, operands ready, the same metadata; the exact form: every
/// call on the fused op's provider, one that gives the chain's bits).
fn fuse_qk_norm_rope(
    graph: &mut Graph,
    cx: &PassContext<'_>,
    exact: bool,
    report: &mut FusionReport,
) -> Result<(), PassError> {
    if !(graph.mentions_op(&ROTARY_EMBEDDING) && graph.mentions_op(&RMS_NORM)) {
        return Ok(());
    }
    let FusionFacts { positions, uses, writes_before } = FusionFacts::compute(graph, cx);
    let mut fusions = Vec::new();
    for &rotary in graph.order() {
        let Some(args) = graph.functional_call_of(rotary, &ROTARY_EMBEDDING) else { continue };
        let (Some(&Arg::Tensor(query)), Some(&Arg::Tensor(key)), Some(&Arg::I64(head_size))) = (
            args.get(RotaryEmbeddingArgs::query),
            args.get(RotaryEmbeddingArgs::key),
            args.get(RotaryEmbeddingArgs::head_size),
        ) else {
            continue;
        };
        if query == key {
            continue;
        }
        let (Some(q), Some(k)) =
            (head_norm(graph, &uses, query, rotary, head_size), head_norm(graph, &uses, key, rotary, head_size))
        else {
            continue;
        };
        let statement = graph.display_node(rotary);
        let skip = |reason| (statement.clone(), reason);
        let epsilon_bits = |arg: &Arg| match arg {
            Arg::F64(e) => Some(e.to_bits()),
            _ => None,
        };
        if epsilon_bits(&q.epsilon).is_none() || epsilon_bits(&q.epsilon) != epsilon_bits(&k.epsilon) {
            report.skipped.push(skip(FusionSkip::EpsilonDiffers));
            continue;
        }
        let first = q.nodes.iter().chain(&k.nodes).map(|&node| positions[node] as usize).min().unwrap_or(0);
        if writes_before[positions[rotary] as usize] - writes_before[first + 1] > 0 {
            report.skipped.push(skip(FusionSkip::WriteBetween { first: RMS_NORM.name, second: ROTARY_EMBEDDING.name }));
            continue;
        }
        let arg = |at: usize| args.get(at).cloned().unwrap_or(Arg::None);
        let mut fused_args = vec![
            arg(RotaryEmbeddingArgs::positions),
            Arg::Tensor(q.x),
            Arg::Tensor(k.x),
            q.weight.clone(),
            k.weight.clone(),
            arg(RotaryEmbeddingArgs::cos_sin_cache),
            q.epsilon.clone(),
            arg(RotaryEmbeddingArgs::head_size),
            arg(RotaryEmbeddingArgs::rotary_dim),
            arg(RotaryEmbeddingArgs::is_neox_style),
        ];
        if let Some(rounding) = args.get(RotaryEmbeddingArgs::rounding) {
            fused_args.push(rounding.clone());
        }
        let replaced = graph.node(rotary).results.to_vec();
        let [rq, rk] = replaced[..] else { continue };
        let expected = [graph.meta(rq), graph.meta(rk)];
        if let Err(why) = same_metadata(graph, &FUSED_QK_NORM_ROPE, &fused_args, ["query", "key"], expected) {
            report.skipped.push(skip(FusionSkip::Metadata(why)));
            continue;
        }
        if exact {
            let norm_args = |h: &HeadNorm| graph.functional_call_of(h.nodes[0], &RMS_NORM).unwrap_or_default();
            let calls = [(&RMS_NORM, norm_args(&q)), (&RMS_NORM, norm_args(&k)), (&ROTARY_EMBEDDING, args)];
            // The cpu composes its norm and rotary rows (the chain's bits); a GPU's generated
            // kernel reduces a head otherwise than its hand-written norm.
            let fused = &FUSED_QK_NORM_ROPE;
            let exact_on: BitExactOn = |provider, _| reduces_like_its_norms(provider);
            if let Some(reason) = not_exact_calls(graph, cx, fused, exact_on, &calls, &fused_args) {
                report.skipped.push(skip(reason));
                continue;
            }
        }
        let removed = q.nodes.into_iter().chain(k.nodes).chain([rotary]).collect();
        fusions.push(QkFusion { rotary, args: fused_args, removed, replaced, statement });
    }
    apply_decided(graph, &positions, fusions, report, |fusion| {
        let call = FusedCall {
            op: FUSED_QK_NORM_ROPE.name,
            anchor: fusion.rotary,
            args: fusion.args,
            removed: fusion.removed,
            replaced: fusion.replaced,
        };
        (fusion.statement, call)
    });
    Ok(())
}
