//! What the fused-add norms defined by row programs share (`fused_add_layer_norm`,
//! `fused_sandwich_rms_norm`): inputs `x`, `x_residual`, two optional `[H]` vectors, `epsilon`;
//! outputs `(out, residual_out)` written in place of both activations; eight programs (each vector
//! present or not, both roundings).

use std::sync::OnceLock;

use ir_core::op::{ArgMeta, OpDef, StrEnum};
use ir_core::{KernelError, Tensor, UniqueTensor};

use crate::Rounding;
use crate::row_program::{InPlaceArg, RowArg, RowProgram};

/// The program of a call with or without each vector in `rounding`, from `programs` (built by
/// `build` at first use).
pub(crate) fn program(
    programs: &'static OnceLock<Vec<RowProgram>>,
    build: fn(bool, bool, Rounding) -> RowProgram,
    [first, second]: [bool; 2],
    rounding: Rounding,
) -> &'static RowProgram {
    let programs = programs.get_or_init(|| {
        let mut programs = Vec::with_capacity(8);
        for rounding in [Rounding::Exact, Rounding::Dtype] {
            for (first, second) in [(false, false), (false, true), (true, false), (true, true)] {
                programs.push(build(first, second, rounding));
            }
        }
        programs
    });
    let rounding = usize::from(rounding == Rounding::Dtype);
    &programs[rounding * 4 + usize::from(first) * 2 + usize::from(second)]
}

/// A tensor argument's metadata, or none.
fn tensor(t: Option<&Tensor>) -> ArgMeta<'_> {
    t.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()))
}

/// The reference implementation: the meta function's checks, `program` on the reference
/// interpreter, and the outputs in the declared layouts (each activation's, when dense).
pub(crate) fn native(
    def: &'static OpDef,
    program: &RowProgram,
    x: &Tensor,
    x_residual: &Tensor,
    vectors: [Option<&Tensor>; 2],
    epsilon: f64,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let metas = [
        ArgMeta::Tensor(x.meta()),
        ArgMeta::Tensor(x_residual.meta()),
        tensor(vectors[0]),
        tensor(vectors[1]),
        ArgMeta::F64(epsilon),
        ArgMeta::Str(rounding.as_str()),
    ];
    (def.meta)(def, &metas)?;
    let mut args = vec![RowArg::Tensor(x), RowArg::Tensor(x_residual)];
    args.extend(vectors.into_iter().flatten().map(RowArg::Tensor));
    args.push(RowArg::Scalar(epsilon));
    let mut outputs = program.run(&args)?;
    let residual = outputs.pop().expect("two outputs").copy_into_layout(x_residual.layout().copy_layout())?;
    let out = outputs.pop().expect("two outputs").copy_into_layout(x.layout().copy_layout())?;
    Ok(if x.device().is_cpu() { (out, residual) } else { (out.to_device_of(x)?, residual.to_device_of(x)?) })
}

/// `program` on an executor that runs it in place (`run`: the cpu's, a GPU backend's), `x` and
/// `x_residual` donated: both outputs written into them.
pub(crate) fn run_in_place(
    run: impl FnOnce(&RowProgram, &mut [InPlaceArg<'_>]) -> Result<Vec<Option<Tensor>>, KernelError>,
    program: &RowProgram,
    mut x: UniqueTensor,
    mut x_residual: UniqueTensor,
    vectors: [Option<&Tensor>; 2],
    epsilon: f64,
) -> Result<(Tensor, Tensor), KernelError> {
    let mut args = vec![InPlaceArg::Donated(&mut x), InPlaceArg::Donated(&mut x_residual)];
    args.extend(vectors.into_iter().flatten().map(|v| InPlaceArg::Read(RowArg::Tensor(v))));
    args.push(InPlaceArg::Read(RowArg::Scalar(epsilon)));
    let fresh = run(program, &mut args)?;
    if fresh.iter().any(Option::is_some) {
        return Err(KernelError::InvalidArguments {
            reason: format!("row program `{}`: an output was not written in place", program.name()),
        });
    }
    Ok((x.into_tensor(), x_residual.into_tensor()))
}
