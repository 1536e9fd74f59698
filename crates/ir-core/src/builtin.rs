//! The built-in tensor operations (`clone`, `contiguous`, `slice`, `transpose`, `reshape`, `add`,
//! `mul`, `scale`, `copy_`), in one table.
//!
//! Each entry gives the name (reserved: no op may take it), the parameter kinds (the graph parser
//! reads the arity and the kinds from it, the printer spells the arguments from it), what the
//! operation does to storage (the passes and the interpreter's safety checks read it), the result
//! metadata (the verifier, the tracer) and the computation (the eager context, the interpreter).
//! Execution contexts have one generic [`ExecutionContext::builtin`](crate::ExecutionContext::builtin)
//! with typed sugar (`slice`, `add`, …). Adding a built-in is one [`Builtin`] variant and its entry
//! here, with its semantics; nothing else names it.

use crate::{Tensor, TensorError, TensorMeta};

/// A built-in operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Builtin {
    /// `clone(x)`: a copy keeping dense strides.
    Clone,
    /// `contiguous(x)`: a compact copy.
    Contiguous,
    /// `slice(x, dim, start, end)`: a view of `start..end` along `dim`.
    Slice,
    /// `transpose(x, d0, d1)`: a view with two dimensions swapped.
    Transpose,
    /// `reshape(x, [dims])`: a view with another shape.
    Reshape,
    /// `add(a, b)`: elementwise sum.
    Add,
    /// `mul(a, b)`: elementwise product.
    Mul,
    /// `scale(x, factor)`: multiplication by a constant.
    Scale,
    /// `copy_(dst, src)`: writes src into dst (converting the dtype); the result aliases dst.
    Copy,
    /// `cat(a, b, dim)`: a and b joined along `dim` (a fresh compact tensor).
    Cat,
}

/// The kind of one parameter of a built-in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuiltinParam {
    /// A value (`%x`).
    Value,
    /// A non-negative integer (a dimension or an index).
    Index,
    /// A list of non-negative integers (a shape).
    Shape,
    /// A float.
    Float,
}

/// One argument of a built-in call: a value of the caller's handle type `V` (a graph's value, a
/// tensor, a traced value) or a scalar.
#[derive(Clone, Debug, PartialEq)]
pub enum BuiltinArg<V> {
    /// A value.
    Value(V),
    /// A dimension or an index.
    Index(usize),
    /// A shape.
    Shape(Vec<usize>),
    /// A float.
    Float(f64),
}

/// What a built-in does to storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// A fresh copy of its first value, which clone elimination may remove (`clone`, `contiguous`).
    Copy,
    /// A view sharing its first value's storage (`slice`, `transpose`, `reshape`).
    View,
    /// A fresh result computed from its values.
    Compute,
    /// Writes into its first value; the result aliases it (`copy_`).
    WriteFirst,
}

/// The scalar arguments of a built-in call, read by parameter position (the table's functions take
/// them this way whatever the caller's value type).
pub trait ScalarArgs {
    /// The index at `position`.
    fn index(&self, position: usize) -> usize;
    /// The shape at `position`.
    fn shape(&self, position: usize) -> &[usize];
    /// The float at `position`.
    fn float(&self, position: usize) -> f64;
}

/// A call's argument list seen as [`ScalarArgs`].
#[derive(Clone, Copy, Debug)]
pub struct Scalars<'a, V>(pub &'a [BuiltinArg<V>]);

impl<V> ScalarArgs for Scalars<'_, V> {
    fn index(&self, position: usize) -> usize {
        match self.0[position] {
            BuiltinArg::Index(v) => v,
            _ => unreachable!("argument kinds are checked against the table before use"),
        }
    }
    fn shape(&self, position: usize) -> &[usize] {
        match &self.0[position] {
            BuiltinArg::Shape(dims) => dims,
            _ => unreachable!("argument kinds are checked against the table before use"),
        }
    }
    fn float(&self, position: usize) -> f64 {
        match self.0[position] {
            BuiltinArg::Float(v) => v,
            _ => unreachable!("argument kinds are checked against the table before use"),
        }
    }
}

/// Computes a result from the values' tensors and the scalar arguments.
pub type ResultFn = fn(&[&Tensor], &dyn ScalarArgs) -> Result<Tensor, TensorError>;
/// Writes into the target (the first value) from the other values' tensors and the scalars.
pub type WriteFn = fn(&mut Tensor, &[&Tensor], &dyn ScalarArgs) -> Result<(), TensorError>;
/// The exact result metadata from the values' metadata and the scalars, or why they are invalid.
pub type MetaFn = fn(&[&TensorMeta], &dyn ScalarArgs) -> Result<TensorMeta, TensorError>;

/// The computation of a built-in.
#[derive(Clone, Copy, Debug)]
pub enum Eval {
    /// Returns the result (a fresh tensor or a view).
    Result(ResultFn),
    /// Writes into the target (the first value); the result aliases it.
    Write(WriteFn),
}

/// One entry of the table.
#[derive(Clone, Copy, Debug)]
pub struct BuiltinDef {
    /// The name in the text format (a reserved word of `ir-core`).
    pub name: &'static str,
    /// The parameters, in order.
    pub params: &'static [BuiltinParam],
    /// What it does to storage.
    pub effect: Effect,
    /// The exact result metadata.
    pub meta: MetaFn,
    /// The computation.
    pub eval: Eval,
}

/// The table, in the order of [`Builtin`]'s variants.
pub static BUILTINS: [BuiltinDef; 10] = {
    use BuiltinParam::{Float, Index, Shape, Value};
    [
        // Clone
        BuiltinDef {
            name: "clone",
            params: &[Value],
            effect: Effect::Copy,
            meta: |m, _| Ok(TensorMeta { layout: m[0].layout.copy_layout(), ..m[0].clone() }),
            eval: Eval::Result(|t, _| t[0].deep_clone()),
        },
        // Contiguous
        BuiltinDef {
            name: "contiguous",
            params: &[Value],
            effect: Effect::Copy,
            meta: |m, _| Ok(m[0].compact_like()),
            eval: Eval::Result(|t, _| t[0].contiguous()),
        },
        // Slice
        BuiltinDef {
            name: "slice",
            params: &[Value, Index, Index, Index],
            effect: Effect::View,
            meta: |m, a| {
                let layout = m[0].layout.slice(a.index(1), a.index(2), a.index(3))?;
                Ok(TensorMeta { layout, ..m[0].clone() })
            },
            eval: Eval::Result(|t, a| t[0].slice(a.index(1), a.index(2), a.index(3))),
        },
        // Transpose
        BuiltinDef {
            name: "transpose",
            params: &[Value, Index, Index],
            effect: Effect::View,
            meta: |m, a| {
                let layout = m[0].layout.transpose(a.index(1), a.index(2))?;
                Ok(TensorMeta { layout, ..m[0].clone() })
            },
            eval: Eval::Result(|t, a| t[0].transpose(a.index(1), a.index(2))),
        },
        // Reshape
        BuiltinDef {
            name: "reshape",
            params: &[Value, Shape],
            effect: Effect::View,
            meta: |m, a| {
                let layout = m[0].layout.reshape(a.shape(1))?;
                Ok(TensorMeta { layout, ..m[0].clone() })
            },
            eval: Eval::Result(|t, a| t[0].reshape(a.shape(1))),
        },
        // Add
        BuiltinDef {
            name: "add",
            params: &[Value, Value],
            effect: Effect::Compute,
            meta: |m, _| elementwise_meta("add", m),
            eval: Eval::Result(|t, _| t[0].add(t[1])),
        },
        // Mul
        BuiltinDef {
            name: "mul",
            params: &[Value, Value],
            effect: Effect::Compute,
            meta: |m, _| elementwise_meta("mul", m),
            eval: Eval::Result(|t, _| t[0].mul(t[1])),
        },
        // Scale
        BuiltinDef {
            name: "scale",
            params: &[Value, Float],
            effect: Effect::Compute,
            meta: |m, _| Ok(m[0].compact_like()),
            eval: Eval::Result(|t, a| t[0].scale(a.float(1))),
        },
        // Copy
        BuiltinDef {
            name: "copy_",
            params: &[Value, Value],
            effect: Effect::WriteFirst,
            meta: |m, _| {
                if m[0].shape() != m[1].shape() {
                    let (lhs, rhs) = (m[0].shape().to_vec(), m[1].shape().to_vec());
                    return Err(TensorError::ShapeMismatch { operation: "copy_", lhs, rhs });
                }
                Ok(m[0].clone())
            },
            eval: Eval::Write(|target, t, _| target.copy_from(t[0])),
        },
        // Cat
        BuiltinDef {
            name: "cat",
            params: &[Value, Value, Index],
            effect: Effect::Compute,
            meta: |m, a| crate::tensor::cat_meta(m[0], m[1], a.index(2)),
            eval: Eval::Result(|t, a| t[0].cat(t[1], a.index(2))),
        },
    ]
};

impl Builtin {
    /// Every built-in, in table order.
    pub const ALL: [Builtin; 10] = [
        Builtin::Clone,
        Builtin::Contiguous,
        Builtin::Slice,
        Builtin::Transpose,
        Builtin::Reshape,
        Builtin::Add,
        Builtin::Mul,
        Builtin::Scale,
        Builtin::Copy,
        Builtin::Cat,
    ];

    /// The built-in spelled `name`.
    pub fn from_name(name: &str) -> Option<Builtin> {
        Builtin::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Its name in the text format.
    pub fn name(self) -> &'static str {
        self.def().name
    }

    /// Its entry in the table.
    pub fn def(self) -> &'static BuiltinDef {
        &BUILTINS[self as usize]
    }

    /// The signature for messages: `slice(value, index, index, index)`.
    pub fn signature(self) -> String {
        let params: Vec<&str> = self
            .def()
            .params
            .iter()
            .map(|p| match p {
                BuiltinParam::Value => "value",
                BuiltinParam::Index => "index",
                BuiltinParam::Shape => "[dims]",
                BuiltinParam::Float => "float",
            })
            .collect();
        format!("{}({})", self.name(), params.join(", "))
    }
}

impl<V> BuiltinArg<V> {
    /// The value, if this is one.
    pub fn value(&self) -> Option<&V> {
        match self {
            BuiltinArg::Value(v) => Some(v),
            _ => None,
        }
    }

    /// Whether the argument has the kind `param` asks for.
    pub fn fits(&self, param: BuiltinParam) -> bool {
        matches!(
            (self, param),
            (BuiltinArg::Value(_), BuiltinParam::Value)
                | (BuiltinArg::Index(_), BuiltinParam::Index)
                | (BuiltinArg::Shape(_), BuiltinParam::Shape)
                | (BuiltinArg::Float(_), BuiltinParam::Float)
        )
    }
}

/// A compact tensor of `m`'s shape, dtype and device.
fn elementwise_meta(operation: &'static str, m: &[&TensorMeta]) -> Result<TensorMeta, TensorError> {
    let (a, b) = (m[0], m[1]);
    if a.shape() != b.shape() {
        return Err(TensorError::ShapeMismatch { operation, lhs: a.shape().to_vec(), rhs: b.shape().to_vec() });
    }
    if a.dtype != b.dtype {
        return Err(TensorError::DTypeMismatch { operation, lhs: a.dtype, rhs: b.dtype });
    }
    if a.device != b.device {
        return Err(TensorError::DeviceMismatch { operation, lhs: a.device, rhs: b.device });
    }
    Ok(a.compact_like())
}

/// Checks `args` against `builtin`'s parameters: the arity and each kind, naming the first misfit.
pub fn check_args<V>(builtin: Builtin, args: &[BuiltinArg<V>]) -> Result<(), String> {
    let params = builtin.def().params;
    if args.len() != params.len() {
        return Err(format!("{} takes {} arguments, found {}", builtin.signature(), params.len(), args.len()));
    }
    match args.iter().zip(params).position(|(arg, &param)| !arg.fits(param)) {
        None => Ok(()),
        Some(i) => Err(format!("argument {i} of {} has the wrong kind", builtin.signature())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_consistent() {
        for builtin in Builtin::ALL {
            let def = builtin.def();
            assert_eq!(Builtin::from_name(def.name), Some(builtin));
            assert!(crate::op::is_reserved(def.name), "`{}` is not reserved", def.name);
            assert_eq!(def.params.first(), Some(&BuiltinParam::Value), "{}: the first argument is a value", def.name);
            let writes = matches!(def.eval, Eval::Write(_));
            assert_eq!(writes, def.effect == Effect::WriteFirst, "{}: effect and computation agree", def.name);
        }
        for word in ["impl", "output", "graph", "none", "true", "false"] {
            assert!(crate::op::is_reserved(word), "`{word}` is a keyword but not reserved");
        }
        assert!(!crate::op::is_reserved("rms_norm"));
        assert_eq!(Builtin::Slice.signature(), "slice(value, index, index, index)");
    }
}
