//! The canonical printer of the text format: every argument explicit and positional, compact
//! strides, offset 0 and `@cpu` omitted, floats in Rust's shortest round-trip form.

use std::fmt::{self, Write};

use crate::{Arg, BuiltinArg, Graph, NodeId, NodeKind};
use ir_core::op::Overload;

pub(crate) fn write_graph(out: &mut impl Write, graph: &Graph) -> fmt::Result {
    write!(out, "graph {}(", graph.name)?;
    for (i, (_, value, _, donated)) in graph.inputs().into_iter().enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        write!(out, "%{}: {}", graph.value_name(value), graph.meta(value))?;
        if donated {
            out.write_str(" donated")?;
        }
    }
    out.write_str(") {\n")?;
    for &node in graph.order() {
        if matches!(graph.node(node).kind, NodeKind::Input { .. }) {
            continue;
        }
        out.write_str("  ")?;
        write_node(out, graph, node)?;
        out.write_str("\n")?;
    }
    out.write_str("}\n")
}

pub(crate) fn write_node(out: &mut impl Write, graph: &Graph, node: NodeId) -> fmt::Result {
    let data = graph.node(node);
    let v = |value| graph.display_value(value);
    if !data.results.is_empty() {
        for (i, &result) in data.results.iter().enumerate() {
            let separator = if i == 0 { "" } else { ", " };
            write!(out, "{separator}%{}", graph.value_name(result))?;
        }
        out.write_str(" = ")?;
    }
    match &data.kind {
        NodeKind::Input { name, donated } => {
            write!(out, "%{name}: {}", graph.meta(data.results[0]))?;
            if *donated {
                out.write_str(" donated")?;
            }
            return Ok(());
        }
        NodeKind::IrCall { op, overload, args } => {
            let suffix = match overload {
                Overload::Default => "",
                Overload::MaybeInplace => ".maybe_inplace",
            };
            write!(out, "{}{suffix}(", graph.op_name(*op))?;
            write_args(out, graph, args)?;
            out.write_str(")")?;
        }
        NodeKind::ImplCall { op, provider, writes, args } => {
            write!(out, "impl {}[{}] ", graph.op_name(*op), graph.provider_name(*provider))?;
            if !writes.is_empty() {
                let writes: Vec<String> = writes.iter().map(ToString::to_string).collect();
                write!(out, "writes({}) ", writes.join(", "))?;
            }
            out.write_str("(")?;
            write_args(out, graph, args)?;
            out.write_str(")")?;
        }
        NodeKind::Builtin { op, args } => {
            write!(out, "{}(", op.name())?;
            for (i, arg) in args.iter().enumerate() {
                if i > 0 {
                    out.write_str(", ")?;
                }
                match arg {
                    BuiltinArg::Value(x) => out.write_str(&v(*x))?,
                    BuiltinArg::Index(index) => write!(out, "{index}")?,
                    BuiltinArg::Shape(dims) => {
                        let dims: Vec<String> = dims.iter().map(usize::to_string).collect();
                        write!(out, "[{}]", dims.join(", "))?
                    }
                    BuiltinArg::Float(f) => out.write_str(&format_float(*f))?,
                }
            }
            out.write_str(")")?;
        }
        NodeKind::Output(values) => {
            let names: Vec<String> = values.iter().map(|&x| v(x)).collect();
            return write!(out, "output({})", names.join(", "));
        }
    }
    let types: Vec<String> = data.results.iter().map(|&r| graph.meta(r).to_string()).collect();
    write!(out, " : {}", types.join(", "))
}

fn write_args(out: &mut impl Write, graph: &Graph, args: &[Arg]) -> fmt::Result {
    for (i, arg) in args.iter().enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        match arg {
            Arg::Tensor(value) => write!(out, "%{}", graph.value_name(*value))?,
            Arg::None => out.write_str("none")?,
            Arg::F64(v) => out.write_str(&format_float(*v))?,
            Arg::I64(v) => write!(out, "{v}")?,
            Arg::Bool(v) => write!(out, "{v}")?,
            Arg::Ints(values) => {
                let items: Vec<String> = values.iter().map(ToString::to_string).collect();
                write!(out, "[{}]", items.join(", "))?;
            }
            Arg::Str(v) => write!(out, "\"{v}\"")?,
            Arg::DType(v) => write!(out, "{v}")?,
        }
    }
    Ok(())
}

/// Rust's `{:?}` for f64 (shortest round trip, always with `.` or an exponent), but `nan`, `inf`, `-inf`.
pub fn format_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".to_owned() } else { "-inf".to_owned() };
    }
    format!("{v:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats() {
        assert_eq!(format_float(1e-6), "1e-6");
        assert_eq!(format_float(0.1), "0.1");
        assert_eq!(format_float(1e300), "1e300");
        assert_eq!(format_float(-0.0), "-0.0");
        assert_eq!(format_float(4.0), "4.0");
        assert_eq!(format_float(f64::NAN), "nan");
        assert_eq!(format_float(f64::NEG_INFINITY), "-inf");
    }
}
