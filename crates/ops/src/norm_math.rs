//! The normative math of `rms_norm` and `fused_add_rms_norm`, shared by both ops.
//!
//! Notation: `c` is the compute dtype (f32; f64 when x is f64). Values are held in `f64` but rounded
//! to `c` after every step the spec computes "in c": for f32 operands, one f64 operation followed by
//! one rounding to f32 gives the correctly rounded f32 result (f64 has more than 2·24 + 2 bits), so
//! this is exactly f32 arithmetic.

use ir_core::op::{ArgMeta, MetaError, OpDef};
use ir_core::{Tensor, TensorError, TensorMeta};

/// The argument of `def`'s parameter `name` in a bound list (`None` when the op has no such
/// parameter): how a meta function shared by several ops reads them.
pub(crate) fn named<'a, 'm>(def: &OpDef, args: &'a [ArgMeta<'m>], name: &str) -> Option<&'a ArgMeta<'m>> {
    def.param_index(name).and_then(|index| args.get(index))
}

/// The meta function of both norms, and the norm's checks of the norm + quantization ops: reads
/// the parameters by name from `def` (`x`, `weight`, `epsilon`, and `x_residual` and
/// `variance_size` where the op has them).
pub(crate) fn norm_meta(def: &'static OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let kind = |param| MetaError::Kind { op, param };
    let arg = |name: &str| named(def, args, name);
    let x = arg("x").and_then(ArgMeta::tensor).ok_or(kind("x"))?;
    if x.layout.rank() == 0 {
        return Err(MetaError::Rank { op, param: "x", expected: "rank >= 1", shape: vec![] });
    }
    MetaError::require_compute_dtype(op, "x", x)?;
    let hidden = x.layout.last_dim();
    optional_vector(def, args, "weight", x)?;
    let mut outputs: ir_core::op::OutputMetas =
        ir_core::op::smallvec![TensorMeta { dtype: x.dtype, device: x.device, layout: x.layout.copy_layout() }];
    if def.param_index("x_residual").is_some() {
        let r = arg("x_residual").and_then(ArgMeta::tensor).ok_or(kind("x_residual"))?;
        MetaError::require_compute_dtype(op, "x_residual", r)?;
        residual_fits(op, r, x)?;
        outputs.push(TensorMeta { dtype: x.dtype, device: x.device, layout: r.layout.copy_layout() });
    }
    let epsilon = arg("epsilon").and_then(ArgMeta::f64).ok_or(kind("epsilon"))?;
    let epsilon_ok = epsilon.is_finite() && epsilon >= 0.0;
    if !epsilon_ok {
        return Err(MetaError::Scalar {
            op,
            param: "epsilon",
            value: format!("{epsilon:?}"),
            reason: "must be finite and >= 0".to_owned(),
        });
    }
    match def.param_index("variance_size").map(|index| args.get(index)) {
        None | Some(Some(ArgMeta::None)) => {}
        Some(Some(ArgMeta::I64(v))) => {
            let in_range = *v >= 1 && (*v as u64) <= hidden as u64;
            if !in_range {
                return Err(MetaError::Scalar {
                    op,
                    param: "variance_size",
                    value: v.to_string(),
                    reason: format!("must lie in 1..={hidden} (the last dimension of x, shape {:?})", x.shape()),
                });
            }
        }
        _ => return Err(kind("variance_size")),
    }
    Ok(outputs)
}

/// `def`'s optional `[H]` vector `param` (a weight or a bias) is absent, or a compute-dtype tensor of
/// x's last dimension on x's device; else the error naming it.
fn optional_vector(
    def: &'static OpDef,
    args: &[ArgMeta<'_>],
    param: &'static str,
    x: &TensorMeta,
) -> Result<(), MetaError> {
    let op = def.name;
    match named(def, args, param) {
        Some(ArgMeta::None) => Ok(()),
        Some(ArgMeta::Tensor(t)) => {
            MetaError::require_compute_dtype(op, param, t)?;
            if t.shape() != [x.layout.last_dim()] {
                return Err(MetaError::Shape {
                    op,
                    param,
                    shape: t.shape().to_vec(),
                    expected: "must be [H] with H the last dimension of x",
                    other: "x",
                    other_shape: x.shape().to_vec(),
                });
            }
            if t.device != x.device {
                return Err(MetaError::Device { op, param, device: t.device, other: "x", other_device: x.device });
            }
            Ok(())
        }
        _ => Err(MetaError::Kind { op, param }),
    }
}

/// `x_residual` has x's shape and device, or the error naming it.
fn residual_fits(op: &'static str, r: &TensorMeta, x: &TensorMeta) -> Result<(), MetaError> {
    if r.shape() != x.shape() {
        return Err(MetaError::Shape {
            op,
            param: "x_residual",
            shape: r.shape().to_vec(),
            expected: "must equal the shape of x",
            other: "x",
            other_shape: x.shape().to_vec(),
        });
    }
    if r.device != x.device {
        return Err(MetaError::Device {
            op,
            param: "x_residual",
            device: r.device,
            other: "x",
            other_device: x.device,
        });
    }
    Ok(())
}

/// The reference computation. Returns `(out, residual_out)`; `residual_out` only when a residual is given.
///
/// Arguments are validated by [`norm_meta`] first. Device tensors go through host memory.
pub(crate) fn native_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: crate::Rounding,
) -> Result<(Tensor, Option<Tensor>), TensorError> {
    let x_host = x.to_cpu()?;
    let residual_host = residual.map(Tensor::to_cpu).transpose()?;
    let weight_values = weight.map(Tensor::to_f64_vec).transpose()?;
    let weight_dtype = weight.map(Tensor::dtype);

    let x_dtype = x.dtype();
    let c = x_dtype.compute_dtype();
    let hidden = x.layout().last_dim();
    let variance = variance_size.map_or(hidden, |v| v as usize);
    let eps_c = c.round(epsilon);
    let round_sum = rounding.rounds_intermediates(x_dtype);

    let mut out = Tensor::zeros_with_layout(x_dtype, x.layout().copy_layout())?;
    let mut residual_out =
        residual_host.as_ref().map(|r| Tensor::zeros_with_layout(x_dtype, r.layout().copy_layout())).transpose()?;

    if x.numel() > 0 {
        let read_x = x_dtype.element_reader();
        let x_bytes = x_host.cpu_buffer().expect("host copy").bytes();
        let mut x_indices = x_host.layout().storage_indices();
        let mut residual_source = residual_host.as_ref().map(|r| {
            let bytes = r.cpu_buffer().expect("host copy").bytes();
            (r.dtype().element_reader(), bytes, r.layout().storage_indices())
        });
        let write = x_dtype.element_writer();
        let out_layout = out.layout().clone();
        let mut out_indices = out_layout.storage_indices();
        let out_bytes = out.cpu_buffer_mut()?.expect("fresh host tensor").bytes_mut();
        let residual_layout = residual_out.as_ref().map(|r| r.layout().clone());
        let mut residual_sink = match (residual_out.as_mut(), residual_layout.as_ref()) {
            (Some(r), Some(layout)) => {
                Some((r.cpu_buffer_mut()?.expect("fresh host tensor").bytes_mut(), layout.storage_indices()))
            }
            _ => None,
        };

        let mut row = vec![0f64; hidden];
        for _ in 0..x.numel() / hidden {
            // Step 1: a_j = c(x_j), or s_j = c(c(x_j) + c(r_j)) for the fused op (then rounded to x's
            // dtype with `dtype` rounding).
            for slot in row.iter_mut() {
                let index = x_indices.next().expect("row-major iteration covers every element");
                *slot = c.round(read_x(x_bytes, index));
            }
            if let Some((read_r, r_bytes, r_indices)) = residual_source.as_mut() {
                let (sink_bytes, sink_indices) = residual_sink.as_mut().expect("fused op has a residual output");
                for slot in row.iter_mut() {
                    let r = c.round(read_r(r_bytes, r_indices.next().expect("same shape as x")));
                    *slot = c.round(*slot + r);
                    // `dtype` rounding: the norm reads the sum as stored (rounded to x's dtype).
                    if round_sum {
                        *slot = x_dtype.round(*slot);
                    }
                    write(sink_bytes, sink_indices.next().expect("same shape as x"), *slot);
                }
            }
            // Step 2: the mean square over the first V elements, accumulated and divided in f64, rounded once.
            let sum_sq: f64 = row[..variance].iter().map(|a| a * a).sum();
            let mean_sq = c.round(sum_sq / variance as f64);
            // Step 3: rstd = 1 / sqrt(ms + eps), each step in c.
            let rstd = c.round(1.0 / c.round(c.round(mean_sq + eps_c).sqrt()));
            // Steps 4–6.
            for (j, a) in row.iter().enumerate() {
                let y = c.round(a * rstd);
                let z = match (&weight_values, weight_dtype) {
                    (Some(w), Some(dw)) => dw.round(dw.round(y) * w[j]),
                    _ => y,
                };
                write(out_bytes, out_indices.next().expect("same shape as x"), z);
            }
        }
    }

    if x.device().is_cpu() {
        return Ok((out, residual_out));
    }
    let residual_out = residual_out.map(|r| r.to_device_of(x)).transpose()?;
    Ok((out.to_device_of(x)?, residual_out))
}

/// The meta function of the norms defined by row programs (`layer_norm`, `fused_add_layer_norm`,
/// `fused_sandwich_rms_norm`): reads `x`, the optional `[H]` vectors `vectors` (weights and
/// biases, each in a compute dtype on x's device), `x_residual` where the op has one (x's shape and
/// device) and `epsilon` (finite and `>= 0`). The outputs: `out` in x's dtype, then `residual_out`
/// in x's dtype where the op has a residual; compact for a functional op, in the dense layout of
/// their activations for an in-place one.
pub(crate) fn row_norm_meta(
    def: &'static OpDef,
    args: &[ArgMeta<'_>],
    vectors: &[&'static str],
) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let kind = |param| MetaError::Kind { op, param };
    let x = named(def, args, "x").and_then(ArgMeta::tensor).ok_or(kind("x"))?;
    if x.layout.rank() == 0 {
        return Err(MetaError::Rank { op, param: "x", expected: "rank >= 1", shape: vec![] });
    }
    MetaError::require_compute_dtype(op, "x", x)?;
    for &param in vectors {
        optional_vector(def, args, param, x)?;
    }
    // A functional op's outputs are compact, as the programs' executors write them; an in-place
    // op's keep each activation's dense layout (an in-place kernel writes into it), as
    // `fused_add_rms_norm`'s do.
    let layout_of = |t: &TensorMeta| {
        if def.allow_inplace { t.layout.copy_layout() } else { ir_core::Layout::compact(t.shape()) }
    };
    let mut outputs: ir_core::op::OutputMetas =
        ir_core::op::smallvec![TensorMeta { dtype: x.dtype, device: x.device, layout: layout_of(x) }];
    if def.param_index("x_residual").is_some() {
        let r = named(def, args, "x_residual").and_then(ArgMeta::tensor).ok_or(kind("x_residual"))?;
        // The residual output is written in place of the residual and read as the norm's input:
        // one dtype for both.
        if r.dtype != x.dtype {
            return Err(MetaError::DType { op, param: "x_residual", dtype: r.dtype, expected: "x's dtype" });
        }
        residual_fits(op, r, x)?;
        outputs.push(TensorMeta { dtype: x.dtype, device: x.device, layout: layout_of(r) });
    }
    let epsilon = named(def, args, "epsilon").and_then(ArgMeta::f64).ok_or(kind("epsilon"))?;
    if !(epsilon.is_finite() && epsilon >= 0.0) {
        return Err(MetaError::Scalar {
            op,
            param: "epsilon",
            value: format!("{epsilon:?}"),
            reason: "must be finite and >= 0".to_owned(),
        });
    }
    Ok(outputs)
}
