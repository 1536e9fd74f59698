//! What a fusion pass reports: the calls it fused and, for each candidate it left, why
//! ([`FusionReport`], [`FusionSkip`]); one type for every fusion pass.

use std::fmt;

/// What a fusion pass did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionReport {
    /// The pattern the pass fuses (`add + rms_norm`, `norm + quantization`).
    pub pattern: &'static str,
    /// The fused calls, printed.
    pub fused: Vec<String>,
    /// The candidates left alone: the statement the pass started from, printed, and why.
    pub skipped: Vec<(String, FusionSkip)>,
}

impl FusionReport {
    /// An empty report of a pass fusing `pattern`.
    pub fn new(pattern: &'static str) -> FusionReport {
        FusionReport { pattern, fused: Vec::new(), skipped: Vec::new() }
    }
}

impl fmt::Display for FusionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fused {} {} pair(s)", self.fused.len(), self.pattern)?;
        for (statement, reason) in &self.skipped {
            write!(f, "; kept `{statement}`: {reason}")?;
        }
        Ok(())
    }
}

/// Why a candidate pair was left unfused.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FusionSkip {
    /// A node between the pair's two calls writes a value.
    WriteBetween {
        /// The first call of the pair (`add`, `norm`).
        first: &'static str,
        /// The second (`norm`, `quantization`).
        second: &'static str,
    },
    /// The fused op's results would not have the replaced values' metadata (or it rejects them).
    Metadata(String),
    /// An operand of the fused call would not be there where the call stands: the pair computes it
    /// (the norm's weight is the sum, the scale is the norm's residual output), or it is defined
    /// after the call's place.
    OperandNotReady {
        /// The operand, printed (`%s`).
        operand: String,
    },
    /// Add + norm: another node reads the sum between the add and the norm, and the norm's weight
    /// is defined after the add, so the fused call fits neither place.
    SumReadBeforeNorm,
    /// Add + norm: the add is already fused with an earlier norm (whose residual result this norm
    /// reads).
    AddAlreadyFused,
    /// Add + norm, exact form: a 16-bit pair the fused op would normalize differently. No longer
    /// given: the exact form fuses such pairs with `rounding = "dtype"`.
    #[deprecated(note = "fuse-add-rms-norm-exact fuses 16-bit pairs with rounding \"dtype\"; nothing reports this")]
    UnroundedSum(ir_core::DType),
    /// Add + norm, exact form: the installed priorities pick another provider for the fused op than
    /// for the norm (it may sum the squares in another order).
    Provider {
        /// The norm's provider.
        norm: String,
        /// The fused op's provider.
        fused: String,
    },
    /// Norm + quantization: the norm is a `maybe_inplace` call (functionalize runs first in the
    /// standard pipeline).
    Donated,
    /// Norm + quantization: the norm has a `variance_size`, which the fused ops do not take.
    VarianceSize,
    /// Norm + quantization: the norm rounds the residual sum to a 16-bit dtype (`rounding =
    /// "dtype"`). No longer given: the fused ops take the same `rounding`.
    #[deprecated(note = "the norm + quantization ops take `rounding`; nothing reports this")]
    RoundedSum,
    /// Norm + quantization: the norm's `rounding` and the static quantization's differ where both
    /// matter (a 16-bit fused-add norm), and the fused op takes one for both.
    RoundingDiffers {
        /// The norm's rounding.
        norm: &'static str,
        /// The quantization's rounding.
        quantization: &'static str,
    },
    /// Norm + quantization: the normalized output has another reader (or is a graph output).
    OtherReaders,
    /// Norm + quantization: the residual output is read before the quantization, whose scale is
    /// defined after the norm.
    NoPlace,
    /// Norm + quantization: a reshape between a norm and a per-token quantization changes the last
    /// dimension (the rows).
    ReshapeChangesRows,
    /// A chain (`fuse-row-programs`): the first call's output has another reader than the second
    /// call's input (the graph's output included), so fusing would compute it twice.
    IntermediateRead {
        /// The first call's op.
        op: &'static str,
    },
    /// A chain of two norms (`fuse-row-programs`): their epsilons differ, and the fused op takes one.
    EpsilonDiffers,
    /// The exact form of `fuse-row-programs`: the installed priorities pick another provider for a
    /// call of the chain than for the fused op (it may reduce in another order).
    ProviderDiffers {
        /// The chain's call.
        op: &'static str,
        /// Its provider.
        provider: String,
        /// The fused op's provider.
        fused: String,
    },
    /// The exact form of `fuse-row-programs`: on this provider the fused op is within its tolerance
    /// of the chain, not bit for bit (a GPU provider's generated kernel reduces or computes
    /// otherwise than its hand-written ones).
    NotBitExact {
        /// The provider.
        provider: String,
    },
}

impl fmt::Display for FusionSkip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FusionSkip::WriteBetween { first, second } => {
                write!(f, "a node between the {first} and the {second} writes a value")
            }
            FusionSkip::Metadata(why) => write!(f, "the fused op's results differ: {why}"),
            FusionSkip::OperandNotReady { operand } => write!(
                f,
                "operand `{operand}` of the fused call is computed by the pair or defined after the call's place"
            ),
            FusionSkip::SumReadBeforeNorm => {
                f.write_str("the sum is read between the add and the norm, whose weight is defined after the add")
            }
            FusionSkip::AddAlreadyFused => f.write_str("the add is already fused with an earlier norm"),
            #[allow(deprecated)]
            FusionSkip::UnroundedSum(dtype) => write!(
                f,
                "in {dtype} the fused op normalizes the unrounded sum (last-bit differences; select `fuse-add-rms-norm` to fuse it)"
            ),
            FusionSkip::Provider { norm, fused } => write!(
                f,
                "the norm runs on `{norm}` but the fused op would run on `{fused}` (select `fuse-add-rms-norm` to fuse it)"
            ),
            FusionSkip::Donated => f.write_str("the norm is a maybe_inplace call"),
            FusionSkip::VarianceSize => f.write_str("the norm has a variance_size"),
            #[allow(deprecated)]
            FusionSkip::RoundedSum => f.write_str("the norm rounds the sum to its 16-bit dtype (rounding \"dtype\")"),
            FusionSkip::RoundingDiffers { norm, quantization } => write!(
                f,
                "the norm's rounding \"{norm}\" and the quantization's \"{quantization}\" differ (the fused op takes one)"
            ),
            FusionSkip::OtherReaders => f.write_str("the normalized output has another reader"),
            FusionSkip::NoPlace => f.write_str(
                "the residual output is read before the quantization, whose scale is defined after the norm",
            ),
            FusionSkip::ReshapeChangesRows => {
                f.write_str("a reshape between the norm and the per-token quantization changes the rows")
            }
            FusionSkip::IntermediateRead { op } => {
                write!(f, "the {op} output has another reader (or is a graph output)")
            }
            FusionSkip::EpsilonDiffers => f.write_str("the two norms' epsilons differ (the fused op takes one)"),
            FusionSkip::ProviderDiffers { op, provider, fused } => write!(
                f,
                "the {op} runs on `{provider}` but the fused op would run on `{fused}` (select `fuse-row-programs` to fuse it)"
            ),
            FusionSkip::NotBitExact { provider } => write!(
                f,
                "on `{provider}` the fused op is within its tolerance of the chain, not bit for bit (select `fuse-row-programs` to fuse it)"
            ),
        }
    }
}
