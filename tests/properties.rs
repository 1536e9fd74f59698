//! Property tests of the passes on random decoder-like graphs: the pipeline's output
//! verifies, interprets to the same bits as the input graph without tripping a safety check, leaves
//! non-donated inputs unmodified, round-trips through text, and clone elimination is idempotent.
//! `PROPTEST_CASES` raises the number of graphs (default 256 per property); `PROPTEST_RNG_SEED`
//! fixes the seed (CI does).

use ir_core::Support;
use ir_core::op::{ArgMeta, Overload};
use ir_core::{DType, Layout, PriorityGuard, Registry, Tensor, TensorMeta, bit_eq};
use ir_graph::{Arg, Builtin, BuiltinArg, Effect, Graph, InterpOptions, NodeKind, ValueId, interpret, parse};
use ir_passes::{CloneElimination, PassContext, Pipeline, Snapshots, eliminate_clones};
use kernel_support::fused_add_rms_norm_support;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    FusedMaybeInplace(u8, u8, bool),
    Fused(u8, u8, bool),
    RmsNorm(u8, bool),
    /// A residual add whose sum an `rms_norm` normalizes at once (what `fuse-add-rms-norm` fuses).
    AddNorm(u8, u8, bool),
    /// `rms_norm` of the value made last (`AddNorm`'s second half).
    RmsNormLast(bool),
    /// Gemma's sandwich (what `fuse-row-programs` fuses after `fuse-add-rms-norm`): `rms_norm`, an
    /// add of its output and a partner, `rms_norm` of the sum.
    Sandwich(u8, u8, bool),
    /// An add of the value made last and a partner (`Sandwich`'s middle).
    AddLast(u8),
    /// A residual add whose sum a `layer_norm` normalizes at once (what `fuse-row-programs` fuses).
    AddLayerNorm(u8, u8, bool),
    /// `layer_norm` of the value made last, with the weight and bias or neither.
    LayerNormLast(bool),
    /// `silu_and_mul` of an even-width value and a per-token fp8 quantization of its output (with
    /// the bound or none); the third byte also puts the gated output in the pool, a second reader.
    SiluQuant(u8, bool, u8),
    Scale(u8),
    Add(u8, u8),
    RowSlice(u8, u8),
    Clone(u8),
    Contiguous(u8),
    ColumnSlice(u8),
    Transpose(u8),
    /// `copy_(dst, src)`: program-level mutation of a value (or a view of it) that others may still read.
    CopyInto(u8, u8),
    /// An explicit in-place `impl fused_add_rms_norm[cpu] writes(0, 1)` in the input graph.
    ImplWrites(u8, u8, bool),
    /// A norm whose output only an fp8 quantization reads (what `fuse-norm-quant` fuses): x, the
    /// residual partner, which pair (`rms_norm` + static, `rms_norm` + per-token,
    /// `fused_add_rms_norm` + static, `fused_add_rms_norm` + per-token: no fused op), the weight.
    NormQuant(u8, u8, u8, bool),
    /// `rotary_embedding` (heads of 8) of a `[T, 8k]` query and, unless the third byte says none,
    /// a key of its dtype (the query itself possible): the query, the key, and the case (key or
    /// none, full or partial rotary, `maybe_inplace` or functional, NeoX or GPT-J).
    Rotary(u8, u8, u8),
    /// Qwen3's attention input (what `fuse-row-programs` fuses into `fused_qk_norm_rope`): the heads
    /// (of 8) of a query and of a key of its dtype each RMS-normalized through a view
    /// (`reshape` to `[T, heads, 8]` and back), then rotated: the query, the key, and the case
    /// (`maybe_inplace` or functional, full or partial rotary, NeoX or GPT-J, one epsilon or two).
    QkNormRope(u8, u8, u8),
    /// A fusion candidate one of whose other operands the pair itself computes: an add + rms_norm
    /// whose weight is the sum (rank 1, `[H]`), or a `fused_add_rms_norm` + static quantization whose
    /// scale is the norm's residual output (`[1]`, f32); the second byte reads the sum before the
    /// norm (the fused call would go to the add's place).
    SelfOperandPair(u8, u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::FusedMaybeInplace(a, b, w)),
        2 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::Fused(a, b, w)),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(a, w)| Step::RmsNorm(a, w)),
        1 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::AddNorm(a, b, w)),
        1 => any::<u8>().prop_map(Step::Scale),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::Add(a, b)),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::RowSlice(a, b)),
        1 => any::<u8>().prop_map(Step::Clone),
        1 => any::<u8>().prop_map(Step::Contiguous),
        1 => any::<u8>().prop_map(Step::ColumnSlice),
        1 => any::<u8>().prop_map(Step::Transpose),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::CopyInto(a, b)),
        2 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::ImplWrites(a, b, w)),
        1 => (any::<u8>(), any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, k, w)| Step::NormQuant(a, b, k, w)),
        1 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(a, b, k)| Step::Rotary(a, b, k)),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, k)| Step::SelfOperandPair(a, k)),
        1 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::Sandwich(a, b, w)),
        1 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::AddLayerNorm(a, b, w)),
        1 => (any::<u8>(), any::<bool>(), any::<u8>()).prop_map(|(a, w, k)| Step::SiluQuant(a, w, k)),
        1 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(a, b, k)| Step::QkNormRope(a, b, k)),
    ]
}

const H: usize = 16;

/// Builds a legal graph: a value donated to a `maybe_inplace` call is never used again (views of it
/// may be: donation through views is the alias-aware elimination's business). Explicit writes
/// (`copy_`, in-place `impl` calls) never target the storage of a non-donated input; after an
/// in-place `impl` call nothing defined before it that shares a written storage is read again (the
/// interpreter's hazard check), while after `copy_` anything may be read (program-level mutation).
fn build(dtype: DType, tokens: usize, inputs: &[(u8, bool, bool)], steps: &[Step], outputs: &[u8]) -> Graph {
    let mut graph = Graph::new("random");
    let dtypes = [dtype, DType::F32, DType::BF16, DType::F16];
    let mut pool: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, &(d, padded, donated))| {
            let input_dtype = if d % 3 == 0 { dtypes[d as usize % 4] } else { dtype };
            let row_stride = if padded { H + 3 } else { H };
            let layout = Layout::new(&[tokens, H], &[row_stride, 1], usize::from(padded)).expect("valid layout");
            let name = format!("in{i}");
            let value = graph.add_input(&name, TensorMeta { dtype: input_dtype, device: ir_core::Device::Cpu, layout });
            if donated {
                graph.mark_donated(&name);
            }
            value
        })
        .collect();
    let weight = graph.add_input("w", TensorMeta::compact(dtype, &[H]));
    // The head norms' weight (heads of 8).
    let head_weight = graph.add_input("w_head", TensorMeta::compact(dtype, &[8]));
    let scale = graph.add_input("scale", TensorMeta::compact(DType::F32, &[1]));
    // Rotary embedding's positions (i64 inputs are drawn in 0..8) and a cos/sin cache of 8 rows per
    // dtype and rotary_dim (8: full rotary of heads of 8; 4: partial).
    let positions = graph.add_input("pos", TensorMeta::compact(DType::I64, &[tokens]));
    let mut caches = std::collections::HashMap::new();
    for cache_dtype in [DType::F32, DType::BF16, DType::F16] {
        for rotary_dim in [4usize, 8] {
            let name = format!("cache_{cache_dtype}_{rotary_dim}");
            let cache = graph.add_input(&name, TensorMeta::compact(cache_dtype, &[8, rotary_dim]));
            caches.insert((cache_dtype, rotary_dim), cache);
        }
    }
    // Quantized results and the rank-1 results of `SelfOperandPair`: graph outputs, never operands
    // of later steps (no op but the quantizations takes 8-bit values; the other steps take [T, H]).
    let mut quantized: Vec<ValueId> = Vec::new();
    let pick = |pool: &[ValueId], i: u8| pool[i as usize % pool.len()];
    // Storage roots (the value whose storage a view or in-place result shares), and which roots the
    // caller did not donate.
    let mut roots: std::collections::HashMap<ValueId, ValueId> = std::collections::HashMap::new();
    let root = |roots: &std::collections::HashMap<ValueId, ValueId>, v: ValueId| roots.get(&v).copied().unwrap_or(v);
    let protected: Vec<ValueId> = graph.inputs().iter().filter(|i| !i.3).map(|i| i.1).collect();
    let steps: Vec<Step> = steps
        .iter()
        .flat_map(|step| match step {
            Step::AddNorm(a, b, w) => vec![Step::Add(*a, *b), Step::RmsNormLast(*w)],
            Step::Sandwich(a, b, w) => vec![Step::RmsNorm(*a, *w), Step::AddLast(*b), Step::RmsNormLast(*w)],
            Step::AddLayerNorm(a, b, w) => vec![Step::Add(*a, *b), Step::LayerNormLast(*w)],
            other => vec![other.clone()],
        })
        .collect();
    for step in &steps {
        if pool.is_empty() {
            break;
        }
        let m = |g: &Graph, v: ValueId| g.meta(v).clone();
        match *step {
            Step::FusedMaybeInplace(a, b, w) | Step::Fused(a, b, w) => {
                let x = pick(&pool, a);
                let same_shape: Vec<ValueId> =
                    pool.iter().copied().filter(|&v| graph.meta(v).shape() == graph.meta(x).shape()).collect();
                let r = pick(&same_shape, b);
                let overload = if matches!(step, Step::FusedMaybeInplace(..)) {
                    Overload::MaybeInplace
                } else {
                    Overload::Default
                };
                let weight_arg =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Tensor(weight) } else { Arg::None };
                let out_meta = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let res_meta = TensorMeta {
                    layout: m(&graph, r).layout.copy_layout(),
                    dtype: graph.meta(x).dtype,
                    ..m(&graph, r)
                };
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("fused_add_rms_norm"),
                    overload,
                    args: vec![Arg::Tensor(x), Arg::Tensor(r), weight_arg, Arg::F64(1e-6), Arg::None],
                };
                let (_, results) = graph.push(kind, vec![out_meta, res_meta]);
                if overload == Overload::MaybeInplace {
                    pool.retain(|&v| v != x && v != r);
                    roots.insert(results[0], root(&roots, x));
                    roots.insert(results[1], root(&roots, r));
                }
                pool.extend(results);
            }
            Step::RmsNorm(_, w) | Step::RmsNormLast(w) => {
                let x = match step {
                    Step::RmsNorm(a, _) => pick(&pool, *a),
                    _ => *pool.last().expect("the add's sum was just made"),
                };
                let weight_arg =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Tensor(weight) } else { Arg::None };
                let out = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("rms_norm"),
                    overload: Overload::Default,
                    args: vec![Arg::Tensor(x), weight_arg, Arg::F64(1e-6), Arg::None],
                };
                pool.extend(graph.push(kind, vec![out]).1);
            }
            Step::AddNorm(..) | Step::Sandwich(..) | Step::AddLayerNorm(..) => {
                unreachable!("expanded into their calls above")
            }
            Step::LayerNormLast(w) => {
                let x = *pool.last().expect("the add's sum was just made");
                let vector =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Tensor(weight) } else { Arg::None };
                let out = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("layer_norm"),
                    overload: Overload::Default,
                    args: vec![Arg::Tensor(x), vector.clone(), vector, Arg::F64(1e-5)],
                };
                pool.extend(graph.push(kind, vec![out]).1);
            }
            Step::SiluQuant(a, w, k) => {
                let even: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| graph.meta(v).shape().last().is_some_and(|d| d % 2 == 0))
                    .collect();
                if even.is_empty() {
                    continue;
                }
                let x = pick(&even, a);
                let mut shape = graph.meta(x).shape().to_vec();
                *shape.last_mut().expect("rank 2") /= 2;
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("silu_and_mul"),
                    overload: Overload::Default,
                    args: vec![Arg::Tensor(x)],
                };
                let gated = graph.push(kind, vec![TensorMeta::compact(graph.meta(x).dtype, &shape)]).1[0];
                let mut scales_shape = shape.clone();
                *scales_shape.last_mut().expect("rank 2") = 1;
                let ub = if w { Arg::Tensor(scale) } else { Arg::None };
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("dynamic_per_token_scaled_fp8_quant"),
                    overload: Overload::Default,
                    args: vec![Arg::Tensor(gated), ub, Arg::DType(DType::F8E4M3FN)],
                };
                let metas =
                    vec![TensorMeta::compact(DType::F8E4M3FN, &shape), TensorMeta::compact(DType::F32, &scales_shape)];
                quantized.extend(graph.push(kind, metas).1);
                if k % 3 == 0 {
                    pool.push(gated);
                }
            }
            Step::Scale(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(
                    graph
                        .push(
                            NodeKind::builtin(Builtin::Scale, vec![BuiltinArg::Value(x), BuiltinArg::Float(0.5)]),
                            vec![out],
                        )
                        .1,
                );
            }
            Step::Add(_, b) | Step::AddLast(b) => {
                let x = match step {
                    Step::Add(a, _) => pick(&pool, *a),
                    _ => *pool.last().expect("the norm's output was just made"),
                };
                let same_kind: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| {
                        graph.meta(v).shape() == graph.meta(x).shape() && graph.meta(v).dtype == graph.meta(x).dtype
                    })
                    .collect();
                let y = pick(&same_kind, b);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(
                    graph
                        .push(
                            NodeKind::builtin(Builtin::Add, vec![BuiltinArg::Value(x), BuiltinArg::Value(y)]),
                            vec![out],
                        )
                        .1,
                );
            }
            Step::RowSlice(a, b) => {
                let x = pick(&pool, a);
                let rows = graph.meta(x).shape()[0];
                let start = b as usize % rows;
                let layout = graph.meta(x).layout.slice(0, start, rows).expect("in range");
                let out = TensorMeta { layout, ..m(&graph, x) };
                let (_, results) = graph.push(
                    NodeKind::builtin(
                        Builtin::Slice,
                        vec![
                            BuiltinArg::Value(x),
                            BuiltinArg::Index(0),
                            BuiltinArg::Index(start),
                            BuiltinArg::Index(rows),
                        ],
                    ),
                    vec![out],
                );
                roots.insert(results[0], root(&roots, x));
                pool.extend(results);
            }
            Step::Clone(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: graph.meta(x).layout.copy_layout(), ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::clone_of(x), vec![out]).1);
            }
            Step::Contiguous(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(
                    graph.push(NodeKind::builtin(Builtin::Contiguous, vec![BuiltinArg::Value(x)]), vec![out]).1,
                );
            }
            Step::ColumnSlice(a) => {
                let x = pick(&pool, a);
                // Eight columns (all of a narrower value) from a multiple of 8, so two slices of
                // one buffer are apart or the same.
                let columns = graph.meta(x).shape()[1];
                let start = if columns >= 16 { 8 * ((a as usize / 7) % (columns / 8)) } else { 0 };
                let end = if columns > 8 { start + 8 } else { columns };
                let layout = graph.meta(x).layout.slice(1, start, end).expect("in range");
                let out = TensorMeta { layout, ..m(&graph, x) };
                let (_, results) = graph.push(
                    NodeKind::builtin(
                        Builtin::Slice,
                        vec![
                            BuiltinArg::Value(x),
                            BuiltinArg::Index(1),
                            BuiltinArg::Index(start),
                            BuiltinArg::Index(end),
                        ],
                    ),
                    vec![out],
                );
                roots.insert(results[0], root(&roots, x));
                pool.extend(results);
            }
            Step::Transpose(a) => {
                let x = pick(&pool, a);
                let layout = graph.meta(x).layout.transpose(0, 1).expect("rank 2");
                let out = TensorMeta { layout, ..m(&graph, x) };
                let (_, results) = graph.push(
                    NodeKind::builtin(
                        Builtin::Transpose,
                        vec![BuiltinArg::Value(x), BuiltinArg::Index(0), BuiltinArg::Index(1)],
                    ),
                    vec![out],
                );
                roots.insert(results[0], root(&roots, x));
                pool.extend(results);
            }
            Step::CopyInto(a, b) => {
                let writable: Vec<ValueId> =
                    pool.iter().copied().filter(|&v| !protected.contains(&root(&roots, v))).collect();
                if writable.is_empty() {
                    continue;
                }
                // Every other copy_ goes through a view when there is one (writes through views).
                let views: Vec<ValueId> =
                    writable.iter().copied().filter(|&v| graph.node(graph.value(v).def).kind.is_view()).collect();
                let dst = if a % 2 == 1 && !views.is_empty() { pick(&views, a / 2) } else { pick(&writable, a) };
                let sources: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| {
                        graph.meta(v).shape() == graph.meta(dst).shape() && root(&roots, v) != root(&roots, dst)
                    })
                    .collect();
                if sources.is_empty() {
                    continue;
                }
                let src = pick(&sources, b);
                let (_, results) = graph.push(
                    NodeKind::builtin(Builtin::Copy, vec![BuiltinArg::Value(dst), BuiltinArg::Value(src)]),
                    vec![m(&graph, dst)],
                );
                roots.insert(results[0], root(&roots, dst));
                pool.extend(results);
            }
            Step::ImplWrites(a, b, w) => {
                let writable: Vec<ValueId> =
                    pool.iter().copied().filter(|&v| !protected.contains(&root(&roots, v))).collect();
                if writable.is_empty() {
                    continue;
                }
                let x = pick(&writable, a);
                let partners: Vec<ValueId> = writable
                    .iter()
                    .copied()
                    .filter(|&v| {
                        graph.meta(v).shape() == graph.meta(x).shape()
                            && graph.meta(v).dtype == graph.meta(x).dtype
                            && root(&roots, v) != root(&roots, x)
                    })
                    .collect();
                if partners.is_empty() {
                    continue;
                }
                let r = pick(&partners, b);
                let use_weight = w && graph.meta(x).dtype == dtype;
                let weight_arg = if use_weight { Arg::Tensor(weight) } else { Arg::None };
                let supported = {
                    let (xm, rm, wm) = (m(&graph, x), m(&graph, r), m(&graph, weight));
                    let weight_meta = if use_weight { ArgMeta::Tensor(&wm) } else { ArgMeta::None };
                    let metas = [
                        ArgMeta::Tensor(&xm),
                        ArgMeta::Tensor(&rm),
                        weight_meta,
                        ArgMeta::F64(1e-6),
                        ArgMeta::None,
                        ArgMeta::Str("exact"),
                    ];
                    matches!(fused_add_rms_norm_support(&metas, ir_core::DeviceKind::Cpu), Support::Yes)
                };
                if !supported {
                    continue;
                }
                let kind = NodeKind::ImplCall {
                    op: graph.op_ref("fused_add_rms_norm"),
                    provider: graph.provider_ref("cpu"),
                    writes: vec![0, 1],
                    args: vec![Arg::Tensor(x), Arg::Tensor(r), weight_arg, Arg::F64(1e-6), Arg::None],
                };
                let (_, results) = graph.push(kind, vec![m(&graph, x), m(&graph, r)]);
                // Nothing defined before the write that shares a written storage is read again.
                let (root_x, root_r) = (root(&roots, x), root(&roots, r));
                pool.retain(|&v| root(&roots, v) != root_x && root(&roots, v) != root_r);
                roots.insert(results[0], root_x);
                roots.insert(results[1], root_r);
                pool.extend(results);
            }
            Step::NormQuant(a, b, k, w) => {
                let x = pick(&pool, a);
                let weight_arg =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Tensor(weight) } else { Arg::None };
                let normalized_meta = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let normalized = if k % 4 < 2 {
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("rms_norm"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(x), weight_arg, Arg::F64(1e-6), Arg::None],
                    };
                    graph.push(kind, vec![normalized_meta]).1[0]
                } else {
                    let same_shape: Vec<ValueId> =
                        pool.iter().copied().filter(|&v| graph.meta(v).shape() == graph.meta(x).shape()).collect();
                    let r = pick(&same_shape, b);
                    let res_meta = TensorMeta {
                        layout: m(&graph, r).layout.copy_layout(),
                        dtype: graph.meta(x).dtype,
                        ..m(&graph, r)
                    };
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("fused_add_rms_norm"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(x), Arg::Tensor(r), weight_arg, Arg::F64(1e-6), Arg::None],
                    };
                    let results = graph.push(kind, vec![normalized_meta, res_meta]).1;
                    pool.push(results[1]);
                    results[0]
                };
                // Every other pair reshapes the normalized output first (heads split for a static
                // quantization, a leading 1 for a per-token one, which keeps the rows).
                let mut normalized = normalized;
                let normalized_shape = graph.meta(normalized).shape().to_vec();
                let dims =
                    if k % 2 == 0 { vec![normalized_shape[0], 2, H / 2] } else { vec![1, normalized_shape[0], H] };
                let reshaped = graph.meta(normalized).layout.reshape(&dims);
                if let (true, Ok(layout), Some(&H)) = (k % 8 >= 4, reshaped, normalized_shape.last()) {
                    let meta = TensorMeta { layout, ..m(&graph, normalized) };
                    let args = vec![BuiltinArg::Value(normalized), BuiltinArg::Shape(dims)];
                    normalized = graph.push(NodeKind::builtin(Builtin::Reshape, args), vec![meta]).1[0];
                }
                let shape = graph.meta(normalized).shape().to_vec();
                let q_meta = TensorMeta::compact(DType::F8E4M3FN, &shape);
                let (op, args, metas) = if k % 2 == 0 {
                    let args = vec![Arg::Tensor(normalized), Arg::Tensor(scale), Arg::DType(DType::F8E4M3FN)];
                    ("static_scaled_fp8_quant", args, vec![q_meta])
                } else {
                    let mut scales_shape = shape.clone();
                    *scales_shape.last_mut().expect("rank 2 or 3") = 1;
                    let ub = if w { Arg::Tensor(scale) } else { Arg::None };
                    let args = vec![Arg::Tensor(normalized), ub, Arg::DType(DType::F8E4M3FN)];
                    (
                        "dynamic_per_token_scaled_fp8_quant",
                        args,
                        vec![q_meta, TensorMeta::compact(DType::F32, &scales_shape)],
                    )
                };
                let kind = NodeKind::IrCall { op: graph.op_ref(op), overload: Overload::Default, args };
                quantized.extend(graph.push(kind, metas).1);
            }
            Step::SelfOperandPair(a, k) => {
                // A row of an activation of the weight's dtype, as a rank-1 [H] view, or the weight.
                let rows: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| {
                        let meta = graph.meta(v);
                        meta.dtype == dtype && meta.shape().len() == 2 && meta.shape()[1] == H
                    })
                    .collect();
                let builtin = |graph: &mut Graph, op, args: Vec<BuiltinArg>, meta: TensorMeta| {
                    graph.push(NodeKind::builtin(op, args), vec![meta]).1[0]
                };
                let row_of = |graph: &mut Graph, v: ValueId, index: usize| {
                    let rows = graph.meta(v).shape()[0];
                    let start = index % rows;
                    let layout = graph.meta(v).layout.slice(0, start, start + 1).expect("in range");
                    let args = vec![
                        BuiltinArg::Value(v),
                        BuiltinArg::Index(0),
                        BuiltinArg::Index(start),
                        BuiltinArg::Index(start + 1),
                    ];
                    let row = builtin(graph, Builtin::Slice, args, TensorMeta { layout, ..m(graph, v) });
                    let shape = graph.meta(row).shape()[1..].to_vec();
                    let layout = graph.meta(row).layout.reshape(&shape).expect("one row is viewable as rank 1");
                    let args = vec![BuiltinArg::Value(row), BuiltinArg::Shape(shape)];
                    builtin(graph, Builtin::Reshape, args, TensorMeta { layout, ..m(graph, row) })
                };
                let read_first = k % 2 == 1;
                if k % 4 < 2 {
                    let x = if rows.is_empty() { weight } else { row_of(&mut graph, pick(&rows, a), a as usize) };
                    let r = builtin(
                        &mut graph,
                        Builtin::Scale,
                        vec![BuiltinArg::Value(weight), BuiltinArg::Float(0.5)],
                        TensorMeta::compact(dtype, &[H]),
                    );
                    let sum = builtin(
                        &mut graph,
                        Builtin::Add,
                        vec![BuiltinArg::Value(x), BuiltinArg::Value(r)],
                        TensorMeta::compact(dtype, &[H]),
                    );
                    if read_first {
                        let args = vec![BuiltinArg::Value(sum), BuiltinArg::Float(2.0)];
                        quantized.push(builtin(&mut graph, Builtin::Scale, args, TensorMeta::compact(dtype, &[H])));
                    }
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("rms_norm"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(sum), Arg::Tensor(sum), Arg::F64(1e-6), Arg::None],
                    };
                    quantized.extend(graph.push(kind, vec![TensorMeta::compact(dtype, &[H])]).1);
                } else {
                    let one = TensorMeta::compact(DType::F32, &[1]);
                    let r = builtin(
                        &mut graph,
                        Builtin::Scale,
                        vec![BuiltinArg::Value(scale), BuiltinArg::Float(0.5)],
                        one.clone(),
                    );
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("fused_add_rms_norm"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(scale), Arg::Tensor(r), Arg::None, Arg::F64(1e-6), Arg::None],
                    };
                    let results = graph.push(kind, vec![one.clone(), one.clone()]).1;
                    if read_first {
                        let args = vec![BuiltinArg::Value(results[1]), BuiltinArg::Float(2.0)];
                        quantized.push(builtin(&mut graph, Builtin::Scale, args, one.clone()));
                    }
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("static_scaled_fp8_quant"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(results[0]), Arg::Tensor(results[1]), Arg::DType(DType::F8E4M3FN)],
                    };
                    quantized.extend(graph.push(kind, vec![TensorMeta::compact(DType::F8E4M3FN, &[1])]).1);
                }
            }
            Step::QkNormRope(a, b, k) => {
                // The heads view, and the norm's result (the view's copy layout) viewed back.
                let heads_of = |graph: &Graph, v: ValueId| match graph.meta(v).shape() {
                    [t, w] if *t == tokens && *w > 0 && w % 8 == 0 => {
                        let heads = graph.meta(v).layout.reshape(&[*t, w / 8, 8]).ok()?;
                        let normed = heads.copy_layout();
                        let back = normed.reshape(&[*t, *w]).ok()?;
                        Some((heads, normed, back))
                    }
                    _ => None,
                };
                let queries: Vec<ValueId> = pool.iter().copied().filter(|&v| heads_of(&graph, v).is_some()).collect();
                if queries.is_empty() {
                    continue;
                }
                let q = pick(&queries, a);
                let q_dtype = graph.meta(q).dtype;
                let keys: Vec<ValueId> = queries.iter().copied().filter(|&v| graph.meta(v).dtype == q_dtype).collect();
                let key = pick(&keys, b);
                let mut normalized = Vec::with_capacity(2);
                for (index, x) in [q, key].into_iter().enumerate() {
                    let (heads, normed, back) = heads_of(&graph, x).expect("filtered above");
                    let view = TensorMeta { layout: heads, ..m(&graph, x) };
                    let heads_shape = view.shape().to_vec();
                    let back_shape = back.shape().to_vec();
                    let reshape = |of: ValueId, shape: Vec<usize>| {
                        NodeKind::builtin(Builtin::Reshape, vec![BuiltinArg::Value(of), BuiltinArg::Shape(shape)])
                    };
                    let (_, heads) = graph.push(reshape(x, heads_shape.clone()), vec![view.clone()]);
                    roots.insert(heads[0], root(&roots, x));
                    let epsilon = if index == 1 && k % 5 == 0 { 1e-5 } else { 1e-6 };
                    let kind = NodeKind::IrCall {
                        op: graph.op_ref("rms_norm"),
                        overload: Overload::Default,
                        args: vec![Arg::Tensor(heads[0]), Arg::Tensor(head_weight), Arg::F64(epsilon), Arg::None],
                    };
                    let normed = graph.push(kind, vec![TensorMeta { layout: normed, ..m(&graph, x) }]).1[0];
                    let back = TensorMeta { layout: back, ..m(&graph, x) };
                    let (_, back) = graph.push(reshape(normed, back_shape), vec![back]);
                    roots.insert(back[0], normed);
                    normalized.push(back[0]);
                }
                let rotary_dim = if k % 2 == 0 { 8 } else { 4 };
                let overload = if k % 4 < 2 { Overload::MaybeInplace } else { Overload::Default };
                let metas = normalized.iter().map(|&v| m(&graph, v)).collect();
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("rotary_embedding"),
                    overload,
                    args: vec![
                        Arg::Tensor(positions),
                        Arg::Tensor(normalized[0]),
                        Arg::Tensor(normalized[1]),
                        Arg::Tensor(caches[&(q_dtype, rotary_dim)]),
                        Arg::I64(8),
                        Arg::I64(rotary_dim as i64),
                        Arg::Bool(k % 8 < 4),
                    ],
                };
                let (_, results) = graph.push(kind, metas);
                if overload == Overload::MaybeInplace {
                    for (&result, &of) in results.iter().zip(&normalized) {
                        roots.insert(result, root(&roots, of));
                    }
                }
                pool.extend(results);
            }
            Step::Rotary(a, b, k) => {
                let queries: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| matches!(graph.meta(v).shape(), [t, w] if *t == tokens && *w > 0 && w % 8 == 0))
                    .collect();
                if queries.is_empty() {
                    continue;
                }
                let q = pick(&queries, a);
                let q_dtype = graph.meta(q).dtype;
                let keys: Vec<ValueId> = queries.iter().copied().filter(|&v| graph.meta(v).dtype == q_dtype).collect();
                let key = (k % 3 != 0).then(|| pick(&keys, b));
                let rotary_dim = if k % 2 == 0 { 8 } else { 4 };
                let overload = if k % 4 < 2 { Overload::MaybeInplace } else { Overload::Default };
                let mut metas = vec![TensorMeta { layout: m(&graph, q).layout.copy_layout(), ..m(&graph, q) }];
                metas.extend(key.map(|k| TensorMeta { layout: m(&graph, k).layout.copy_layout(), ..m(&graph, k) }));
                let kind = NodeKind::IrCall {
                    op: graph.op_ref("rotary_embedding"),
                    overload,
                    args: vec![
                        Arg::Tensor(positions),
                        Arg::Tensor(q),
                        key.map_or(Arg::None, Arg::Tensor),
                        Arg::Tensor(caches[&(q_dtype, rotary_dim)]),
                        Arg::I64(8),
                        Arg::I64(rotary_dim as i64),
                        Arg::Bool(k % 8 < 4),
                    ],
                };
                let (_, results) = graph.push(kind, metas);
                if overload == Overload::MaybeInplace {
                    pool.retain(|&v| v != q && Some(v) != key);
                    roots.insert(results[0], root(&roots, q));
                    if let (Some(key), Some(&result)) = (key, results.get(1)) {
                        roots.insert(result, root(&roots, key));
                    }
                }
                pool.extend(results);
            }
        }
    }
    let mut outs: Vec<ValueId> = outputs.iter().filter(|_| !pool.is_empty()).map(|&o| pick(&pool, o)).collect();
    outs.dedup();
    outs.extend(quantized);
    if outs.is_empty() {
        outs.push(weight);
    }
    graph.set_output(outs);
    graph
}

/// Graphs per property: 256, or `PROPTEST_CASES`. CI fixes the seed with `PROPTEST_RNG_SEED`.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

fn registry() -> (Registry, Vec<PriorityGuard>) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    let ops = [
        "fused_add_rms_norm",
        "rms_norm",
        "static_scaled_fp8_quant",
        "dynamic_per_token_scaled_fp8_quant",
        "rms_norm_static_fp8_quant",
        "rms_norm_dynamic_per_token_quant",
        "fused_add_rms_norm_static_fp8_quant",
        "fused_add_rms_norm_dynamic_per_token_quant",
        "rotary_embedding",
        "layer_norm",
        "fused_add_layer_norm",
        "fused_sandwich_rms_norm",
        "silu_and_mul",
        "silu_and_mul_dynamic_fp8_quant",
        "fused_qk_norm_rope",
    ];
    let guards = ops.iter().map(|op| registry.override_priority(op, &["cpu", "native"]).unwrap()).collect();
    (registry, guards)
}

/// The cpu provider registered (explicit `impl …[cpu]` calls need it) but every op dispatched to
/// `native`: the fused and the unfused forms run the same provider.
fn native_registry() -> (Registry, [PriorityGuard; 2]) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    let guards = [
        registry.override_priority("fused_add_rms_norm", &["native"]).unwrap(),
        registry.override_priority("rms_norm", &["native"]).unwrap(),
    ];
    (registry, guards)
}

fn inputs(graph: &Graph, seed: u64) -> Vec<(String, Tensor)> {
    graph
        .inputs()
        .into_iter()
        .enumerate()
        .map(|(i, (_, value, name, _))| {
            (name.to_owned(), Tensor::randn(graph.meta(value), seed * 31 + i as u64).unwrap())
        })
        .collect()
}

fn graphs() -> impl Strategy<Value = Graph> {
    (
        prop_oneof![Just(DType::BF16), Just(DType::F32), Just(DType::F16)],
        1usize..5,
        proptest::collection::vec((any::<u8>(), any::<bool>(), any::<bool>()), 1..4),
        proptest::collection::vec(step(), 1..12),
        proptest::collection::vec(any::<u8>(), 1..4),
    )
        .prop_map(|(dtype, tokens, inputs, steps, outputs)| build(dtype, tokens, &inputs, &steps, &outputs))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_alias_aware_pipeline_preserves_results(graph in graphs(), seed in 0u64..1000) {
        let (registry, _guards) = registry();
        ir_graph::verify(&graph, &registry).unwrap();
        let text = graph.to_string();
        prop_assert!(parse(&text).unwrap().structurally_eq(&graph), "round trip\n{}", text);

        let reference_inputs = inputs(&graph, seed);
        let reference_handles = non_donated_handles(&graph, &reference_inputs);
        let reference = interpret(&graph, &registry, reference_inputs, InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();

        // Non-donated inputs: the caller keeps a handle and must read the same bits afterwards.
        let given = inputs(&compiled, seed);
        let kept: Vec<(String, Tensor, Tensor, bool)> = compiled
            .inputs()
            .into_iter()
            .map(|(_, _, name, donated)| {
                let t = given.iter().find(|(n, _)| n == name).unwrap().1.clone();
                (name.to_owned(), t.clone(), t.deep_clone().unwrap(), donated)
            })
            .collect();
        let run = interpret(&compiled, &registry, given, InterpOptions::checked())
            .unwrap_or_else(|e| panic!("{e}\nbefore:\n{text}\nafter:\n{compiled}"));
        for (a, b) in run.outputs.iter().zip(&reference.outputs) {
            prop_assert!(bit_eq(a, b), "outputs differ\nbefore:\n{}\nafter:\n{}", text, compiled);
        }
        for (name, handle, before, donated) in &kept {
            if !donated {
                prop_assert!(bit_eq(handle, before), "non-donated input %{} was modified", name);
            }
        }
        // The pipeline never makes an output share storage with a non-donated input or with
        // another output, unless the input graph itself returned them aliased.
        let compiled_handles: Vec<(String, Tensor)> =
            kept.iter().filter(|k| !k.3).map(|k| (k.0.clone(), k.1.clone())).collect();
        let before = output_aliasing(&reference.outputs, &reference_handles);
        let after = output_aliasing(&run.outputs, &compiled_handles);
        prop_assert!(
            after.iter().all(|pair| before.contains(pair)),
            "outputs alias {:?} after the pipeline, {:?} before\nbefore:\n{}\nafter:\n{}", after, before, text, compiled
        );
        let again = eliminate_clones(&mut compiled, &cx).unwrap();
        prop_assert!(again.removed.is_empty(), "clone elimination is idempotent");
    }

    /// Fusion with the same (native) providers: bit for bit when every fused pair is f32 (the
    /// fused op normalizes the sum in the dtype itself); with 16-bit pairs the graph still verifies
    /// and runs without tripping a safety check (their last-bit differences may grow through later
    /// ops, so the values are checked pair by pair below instead).
    #[test]
    fn fusing_add_rms_norm_is_bit_exact_for_f32_with_the_same_providers(graph in graphs(), seed in 0u64..1000) {
        let (registry, _guards) = native_registry();
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry);
        let fused = ir_passes::fuse_add_rms_norm(&mut compiled, &cx).unwrap();
        ir_graph::verify(&compiled, &registry).unwrap_or_else(|e| panic!("{e}\nbefore:\n{graph}\nafter:\n{compiled}"));
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        let run = interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked())
            .unwrap_or_else(|e| panic!("{e}\nbefore:\n{graph}\nafter:\n{compiled}"));
        if fused.fused.iter().all(|statement| !statement.contains("f16[")) {
            for (a, b) in run.outputs.iter().zip(&reference.outputs) {
                prop_assert!(bit_eq(a, b), "outputs differ\nbefore:\n{}\nafter:\n{}", graph, compiled);
            }
        }
    }

    /// One fused pair against the unfused pair, any dtype and shape: the sum bit for bit, the norm
    /// within the fused op's tolerance (the pass's rounding claim).
    #[test]
    fn a_fused_pair_keeps_the_sum_and_the_norm_within_tolerance(
        dtype in prop_oneof![Just("bf16"), Just("f16"), Just("f32")],
        rows in 1usize..6,
        hidden in 1usize..80,
        weighted in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let (registry, _guards) = native_registry();
        let weight = if weighted { "%w" } else { "none" };
        let text = format!(
            "graph g(%x: {dtype}[{rows},{hidden}], %r: {dtype}[{rows},{hidden}], %w: {dtype}[{hidden}]) {{\n\
               %s = add(%x, %r) : {dtype}[{rows},{hidden}]\n\
               %o = rms_norm(%s, {weight}, 1e-6, none) : {dtype}[{rows},{hidden}]\n\
               output(%o, %s)\n}}\n"
        );
        let graph = parse(&text).unwrap();
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut fused = graph.clone();
        let report = ir_passes::fuse_add_rms_norm(&mut fused, &PassContext::new(&registry)).unwrap();
        prop_assert_eq!(report.fused.len(), 1);
        let run = interpret(&fused, &registry, inputs(&fused, seed), InterpOptions::checked()).unwrap();
        prop_assert!(bit_eq(&run.outputs[1], &reference.outputs[1]), "the sum is bit for bit");
        let t = ir_core::op::tolerance(&ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM, run.outputs[0].dtype()).unwrap();
        let close = ir_core::allclose(&run.outputs[0], &reference.outputs[0], t.atol, t.rtol);
        prop_assert!(close.is_ok(), "{:?}\n{}", close, text);
        if dtype == "f32" {
            prop_assert!(bit_eq(&run.outputs[0], &reference.outputs[0]), "f32 is bit for bit");
        }
    }

    #[test]
    fn the_unsafe_pipeline_output_verifies_and_is_idempotent(graph in graphs()) {
        let (registry, _guards) = registry();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::Unsafe);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        let once = compiled.to_string();
        let again = eliminate_clones(&mut compiled, &cx).unwrap();
        prop_assert!(again.removed.is_empty(), "a second run removed {:?}\nbefore:\n{}\nafter one run:\n{}", again.removed, graph, once);
        prop_assert!(parse(&compiled.to_string()).unwrap().structurally_eq(&compiled));
    }
}

/// Handles to the inputs the graph does not mark donated (the caller keeps them), by name.
fn non_donated_handles(graph: &Graph, given: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    given.iter().filter(|(name, _)| graph.inputs().iter().any(|i| i.2 == name && !i.3)).cloned().collect()
}

/// Which outputs share storage with another output (`out0~out1`) or with a non-donated input (`out0~%x`).
fn output_aliasing(outputs: &[Tensor], inputs: &[(String, Tensor)]) -> Vec<String> {
    let mut pairs = Vec::new();
    for (i, a) in outputs.iter().enumerate() {
        for (j, b) in outputs.iter().enumerate().skip(i + 1) {
            if ir_core::shares_storage(a, b) {
                pairs.push(format!("out{i}~out{j}"));
            }
        }
        for (name, input) in inputs {
            if ir_core::shares_storage(a, input) {
                pairs.push(format!("out{i}~%{name}"));
            }
        }
    }
    pairs
}

/// The generator is not vacuous about what the rules need covered: it emits `copy_`, explicit
/// in-place `impl` calls, writes through views and graphs whose outputs alias each other or an input.
#[test]
fn the_generator_emits_explicit_writes_views_and_aliased_outputs() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let (mut copies, mut impl_writes, mut view_writes, mut aliased_outputs) = (0, 0, 0, 0);
    for _ in 0..600 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let is_view = |v: ValueId| graph.node(graph.value(v).def).kind.is_view();
        for &node in graph.order() {
            match &graph.node(node).kind {
                kind @ NodeKind::Builtin { op: Builtin::Copy, .. } => {
                    let dst = kind.builtin_subject(Effect::WriteFirst).expect("copy_ writes its first value");
                    copies += 1;
                    view_writes += usize::from(is_view(dst));
                }
                NodeKind::ImplCall { writes, args, .. } if !writes.is_empty() => {
                    impl_writes += 1;
                    let through_view = writes.iter().any(|&p| matches!(args[p], Arg::Tensor(v) if is_view(v)));
                    view_writes += usize::from(through_view);
                }
                _ => {}
            }
        }
        let outputs = graph.outputs();
        let defined_by_view_or_input = outputs
            .iter()
            .any(|&v| is_view(v) || matches!(graph.node(graph.value(v).def).kind, NodeKind::Input { .. }));
        aliased_outputs += usize::from(defined_by_view_or_input);
    }
    eprintln!(
        "600 graphs: {copies} copy_, {impl_writes} in-place impl calls, {view_writes} writes through views, \
         {aliased_outputs} graphs returning an input or a view"
    );
    assert!(copies > 0 && impl_writes > 0 && view_writes > 0 && aliased_outputs > 0);
}

/// The fusion property is not vacuous: the generator's graphs hold add + rms_norm pairs that fuse,
/// and ones the pass refuses.
#[test]
fn the_generator_gives_add_rms_norm_pairs_to_fuse() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let (mut fused, mut kept) = (0, 0);
    for _ in 0..600 {
        let mut graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let report = ir_passes::fuse_add_rms_norm(&mut graph, &cx).unwrap();
        fused += report.fused.len();
        kept += report.skipped.len();
    }
    eprintln!("600 graphs: {fused} add + rms_norm pairs fused, {kept} kept");
    assert!(fused > 0, "the generator makes fusable pairs");
}

/// The generator builds fusion candidates one of whose operands the pair itself computes (the
/// norm's weight is the sum; the quantization's scale is the residual output), which both fusions
/// must keep, and the pipeline compiles them (the pipeline property above runs them).
#[test]
fn the_generator_gives_pairs_whose_operands_the_pair_computes() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let (mut add_norm, mut norm_quant) = (0, 0);
    for _ in 0..600 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let mut fused = graph.clone();
        let report = ir_passes::fuse_add_rms_norm(&mut fused, &cx).unwrap();
        add_norm +=
            report.skipped.iter().filter(|(_, r)| matches!(r, ir_passes::FusionSkip::OperandNotReady { .. })).count();
        let report = ir_passes::fuse_norm_quant(&mut fused, &cx).unwrap();
        norm_quant +=
            report.skipped.iter().filter(|(_, r)| matches!(r, ir_passes::FusionSkip::OperandNotReady { .. })).count();
        let mut compiled = graph.clone();
        Pipeline::standard()
            .run(&mut compiled, &cx, None, Snapshots::Skip)
            .unwrap_or_else(|e| panic!("a valid graph fails to compile: {e}\n{graph}"));
    }
    eprintln!(
        "600 graphs: kept {add_norm} add + rms_norm and {norm_quant} norm + quantization pairs for their operands"
    );
    assert!(add_norm > 0 && norm_quant > 0, "the generator makes both kinds");
}

/// The generator's norm + quantization steps give `fuse-norm-quant` pairs to fuse (all four fused
/// ops) and pairs it must keep (the normalized output read elsewhere, an operand not ready), so the
/// pipeline property above covers the fusion; and the fused graphs run bit for bit like the unfused ones on
/// the cpu provider.
#[test]
fn the_generator_gives_norm_quant_pairs_to_fuse() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let (mut fused, mut kept, mut by_op) = (0, 0, std::collections::BTreeMap::<String, usize>::new());
    let mut through_reshapes = 0;
    for seed in 0..600u64 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let mut compiled = graph.clone();
        let report = ir_passes::fuse_norm_quant(&mut compiled, &cx).unwrap();
        fused += report.fused.len();
        kept += report.skipped.len();
        for statement in &report.fused {
            let op = statement.split(" = ").nth(1).and_then(|rest| rest.split('(').next()).unwrap_or("?");
            *by_op.entry(op.to_owned()).or_default() += 1;
        }
        if report.fused.is_empty() {
            continue;
        }
        // A reshape the fusion moved after the fused call reads one of its results.
        let moved = report.fused.iter().any(|statement| {
            let results = statement.split(" = ").next().unwrap_or("");
            results.split(", ").any(|r| compiled.to_string().contains(&format!("reshape({r},")))
        });
        through_reshapes += usize::from(moved);
        ir_graph::verify(&compiled, &registry).unwrap_or_else(|e| panic!("{e}\nbefore:\n{graph}\nafter:\n{compiled}"));
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let run = interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked()).unwrap();
        for (a, b) in run.outputs.iter().zip(&reference.outputs) {
            assert!(bit_eq(a, b), "outputs differ\nbefore:\n{graph}\nafter:\n{compiled}");
        }
    }
    eprintln!(
        "600 graphs: {fused} norm + quantization pairs fused ({by_op:?}; {through_reshapes} graphs through a reshape), \
         {kept} kept"
    );
    assert_eq!(by_op.len(), 4, "every fused op is made: {by_op:?}");
    assert!(through_reshapes > 0, "some fusions move a reshape");
    assert!(kept > 0, "the generator makes pairs the pass must keep");
}

/// The generator's sandwich, add + LayerNorm and silu + quantization chains give
/// `fuse-row-programs` chains to fuse (every fused op) and to keep; on the cpu the exact form fuses
/// them all, and the standard pipeline that runs it keeps the graphs' bits (the pipeline property
/// above runs it on every graph too). By name, the fused graphs run without tripping a safety
/// check.
#[test]
fn the_generator_gives_row_program_chains_to_fuse() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let (mut by_op, mut exact_by_op) =
        (std::collections::BTreeMap::<String, usize>::new(), std::collections::BTreeMap::<String, usize>::new());
    let mut kept = std::collections::BTreeSet::new();
    let op_of = |statement: &str| {
        statement.split(" = ").nth(1).and_then(|rest| rest.split('(').next()).unwrap_or("?").to_owned()
    };
    for seed in 0..600u64 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        // By name, after fuse-add-rms-norm (the form a sandwich is found in).
        let mut fused = graph.clone();
        ir_passes::fuse_add_rms_norm_exact(&mut fused, &cx).unwrap();
        let report = ir_passes::fuse_row_programs(&mut fused, &cx).unwrap();
        for statement in &report.fused {
            *by_op.entry(op_of(statement)).or_default() += 1;
        }
        for (_, reason) in &report.skipped {
            kept.insert(format!("{reason:?}").split([' ', '{', '(']).next().unwrap_or("?").to_owned());
        }
        ir_graph::verify(&fused, &registry).unwrap_or_else(|e| panic!("{e}\nbefore:\n{graph}\nafter:\n{fused}"));
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        // Within tolerance chain by chain (last-bit differences may grow through later ops, as
        // for fuse-add-rms-norm), so here the fused graph only has to run without tripping a
        // safety check; the golden files compare single chains.
        interpret(&fused, &registry, inputs(&fused, seed), InterpOptions::checked())
            .unwrap_or_else(|e| panic!("{e}\nbefore:\n{graph}\nafter:\n{fused}"));
        // The exact form, in the standard pipeline: bit for bit.
        let mut compiled = graph.clone();
        let report = Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        for run in &report.runs {
            if let ir_passes::PassReport::Fusion(fusion) = &run.report
                && run.pass == ir_passes::PassName::FuseRowProgramsExact
            {
                for statement in &fusion.fused {
                    *exact_by_op.entry(op_of(statement)).or_default() += 1;
                }
            }
        }
        let run = interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked()).unwrap();
        for (a, b) in run.outputs.iter().zip(&reference.outputs) {
            assert!(bit_eq(a, b), "outputs differ\nbefore:\n{graph}\nafter:\n{compiled}");
        }
    }
    eprintln!("600 graphs: fused {by_op:?} by name, {exact_by_op:?} exactly; kept for {kept:?}");
    assert_eq!(by_op.len(), 4, "every fused op is made: {by_op:?}");
    assert_eq!(exact_by_op.len(), 4, "the exact form fuses every chain on the cpu: {exact_by_op:?}");
    assert!(kept.contains("EpsilonDiffers"), "head norms of two epsilons are kept: {kept:?}");
    assert!(kept.contains("IntermediateRead"), "the generator makes chains the pass must keep: {kept:?}");
}

/// A sandwich and an add + LayerNorm of any width and dtype, through the standard pipeline on the
/// cpu: fused, and bit for bit the unfused graph (the cpu reduces a row in one order, fused or not).
#[test]
fn fused_norm_chains_keep_their_bits_at_every_width() {
    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    for dtype in ["f32", "bf16", "f16"] {
        for (rows, hidden) in [(1, 1), (3, 7), (2, 31), (5, 33), (4, 64), (3, 257), (2, 1030), (1, 4099)] {
            let text = format!(
                "graph g(%a: {dtype}[{rows},{hidden}], %r: {dtype}[{rows},{hidden}], %w: {dtype}[{hidden}], %b: {dtype}[{hidden}]) {{\n\
                   %h = rms_norm(%a, %w, 1e-6, none) : {dtype}[{rows},{hidden}]\n\
                   %s = add(%h, %r) : {dtype}[{rows},{hidden}]\n\
                   %n = rms_norm(%s, %b, 1e-6, none) : {dtype}[{rows},{hidden}]\n\
                   %s2 = add(%n, %s) : {dtype}[{rows},{hidden}]\n\
                   %y = layer_norm(%s2, %w, %b, 1e-5) : {dtype}[{rows},{hidden}]\n\
                   output(%y, %s2)\n}}\n"
            );
            let graph = parse(&text).unwrap();
            let mut compiled = graph.clone();
            Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
            let printed = compiled.to_string();
            assert!(
                printed.contains("fused_sandwich_rms_norm[cpu]") && printed.contains("fused_add_layer_norm[cpu]"),
                "{printed}"
            );
            for seed in 0..3 {
                let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
                let run = interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked()).unwrap();
                for (a, b) in run.outputs.iter().zip(&reference.outputs) {
                    assert!(bit_eq(a, b), "{dtype} [{rows}, {hidden}] seed {seed}: outputs differ\n{printed}");
                }
            }
        }
    }
}

/// The generator exercises rotary embedding's optional activation: with and without a key,
/// donated and functional; the standard pipeline lowers every call to the cpu kernel in place
/// (`writes` names the given activations only) and the outputs keep their bits.
#[test]
fn the_generator_gives_rotary_calls_with_and_without_a_key() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let mut seen = std::collections::BTreeMap::<(bool, bool), usize>::new();
    let (mut lowered_one, mut lowered_two, mut on_views) = (0, 0, 0);
    for seed in 0..400u64 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let text = graph.to_string();
        for line in text.lines().filter(|l| l.contains("rotary_embedding")) {
            let key = !line.contains(", none, %cache");
            *seen.entry((line.contains(".maybe_inplace("), key)).or_default() += 1;
        }
        if !text.contains("rotary_embedding") {
            continue;
        }
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        let after = compiled.to_string();
        lowered_one += after.matches("impl rotary_embedding[cpu] writes(1) ").count();
        lowered_two += after.matches("impl rotary_embedding[cpu] writes(1, 2) ").count();
        // A call writing a strided view where it is (a result in the view's layout): no copy.
        on_views += after
            .lines()
            .filter(|l| {
                l.contains("impl rotary_embedding[cpu]") && l.rsplit(" : ").next().is_some_and(|t| t.contains('{'))
            })
            .count();
        let run = interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked())
            .unwrap_or_else(|e| panic!("{e}\nbefore:\n{text}\nafter:\n{after}"));
        for (a, b) in run.outputs.iter().zip(&reference.outputs) {
            assert!(bit_eq(a, b), "outputs differ\nbefore:\n{text}\nafter:\n{after}");
        }
    }
    eprintln!(
        "400 graphs: rotary calls by (maybe_inplace, key) {seen:?}; lowered writes(1) {lowered_one}, writes(1, 2) \
         {lowered_two}; {on_views} written in place on a strided view"
    );
    assert!(on_views > 0, "some calls write a column slice where it is");
    assert_eq!(seen.len(), 4, "donated and functional, with and without a key: {seen:?}");
    assert!(lowered_one > 0 && lowered_two > 0, "lowered with one and with two written activations");
}

/// The counter-check: the same generator finds graphs where the `unsafe` variant changes results or
/// trips the interpreter's safety checks, so the soundness property above is not vacuous.
#[test]
fn the_generator_finds_graphs_the_unsafe_variant_gets_wrong() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let mut caught = 0;
    for seed in 0..600u64 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::Unsafe);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        match interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked()) {
            Err(_) => caught += 1,
            Ok(run) => {
                if run.outputs.iter().zip(&reference.outputs).any(|(a, b)| !bit_eq(a, b)) {
                    caught += 1;
                }
            }
        }
    }
    assert!(caught > 0, "the generator never produced a graph the unsafe variant mishandles");
    eprintln!("the unsafe variant was caught on {caught} of 600 generated graphs");
}

/// Graphs with one illegal reuse planted on purpose: a value read after a `maybe_inplace` call that
/// donated it.
fn illegal_graphs() -> impl Strategy<Value = (Graph, String, String, String)> {
    (graphs(), any::<u8>()).prop_filter_map("needs a maybe_inplace call", |(mut graph, pick)| {
        let calls: Vec<_> = graph
            .order()
            .iter()
            .copied()
            .filter(|&n| matches!(graph.node(n).kind, NodeKind::IrCall { overload: Overload::MaybeInplace, .. }))
            .collect();
        let call = *calls.get(pick as usize % calls.len().max(1))?;
        let NodeKind::IrCall { op, args, .. } = &graph.node(call).kind else { return None };
        // One of the call's given activations (an absent optional one is `none`).
        let def = ir_ops::BUILTIN_OPS.iter().find(|d| d.name == graph.op_name(*op))?;
        let given: Vec<ValueId> = (def.activation_indices().ok()?.into_iter())
            .filter_map(|i| match args.get(i) {
                Some(Arg::Tensor(v)) => Some(*v),
                _ => None,
            })
            .collect();
        let donated = *given.get((pick as usize / 7) % given.len().max(1))?;
        let meta = TensorMeta { layout: Layout::compact(graph.meta(donated).shape()), ..graph.meta(donated).clone() };
        let (reader, results) = graph.push(
            NodeKind::builtin(Builtin::Scale, vec![BuiltinArg::Value(donated), BuiltinArg::Float(3.0)]),
            vec![meta],
        );
        let mut outputs = graph.outputs();
        outputs.push(results[0]);
        graph.set_output(outputs);
        let (value, donor, later) =
            (graph.display_value(donated), graph.display_node(call), graph.display_node(reader));
        Some((graph, value, donor, later))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn every_illegal_reuse_is_reported_with_the_right_nodes((graph, value, donor, later) in illegal_graphs()) {
        let (registry, _guards) = registry();
        let mut compiled = graph.clone();
        let err = ir_passes::functionalize(&mut compiled, &PassContext::new(&registry)).unwrap_err();
        let ir_passes::PassError::DonatedValueReused { violations } = &err else { panic!("{err}") };
        prop_assert!(
            violations.iter().any(|v| v.value == value && v.donating_node == donor && v.later_user == later),
            "{:?} lacks ({}, {}, {})", violations, value, donor, later
        );
        prop_assert_eq!(compiled.to_string(), graph.to_string(), "a failing pass leaves the graph unchanged");
    }
}
