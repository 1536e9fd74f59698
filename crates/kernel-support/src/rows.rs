//! The row geometry of the norms: which norm a kernel is, a tensor seen as rows (`Rows`), the
//! arguments a row kernel reads (`RowArgs`), and the `variance_size` rule.

use std::borrow::Cow;

use ir_core::{KernelError, TensorMeta};

use crate::{kernel_int, out_of_range};

/// Which of the two norm kernels a GPU variant is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormOp {
    /// `rms_norm`, writing a fresh output.
    RmsNorm,
    /// `fused_add_rms_norm`, in place.
    FusedAddRmsNorm,
}

impl NormOp {
    /// The op's name, the first part of every kernel symbol (`<op>_<dtype>`).
    pub fn name(self) -> &'static str {
        match self {
            NormOp::RmsNorm => "rms_norm",
            NormOp::FusedAddRmsNorm => "fused_add_rms_norm",
        }
    }
}

/// A tensor seen as `n_rows` rows of `hidden` contiguous elements, one row stride apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Number of rows (product of the leading dimensions).
    pub n_rows: usize,
    /// Elements per row (the last dimension).
    pub hidden: usize,
    /// Elements between the starts of consecutive rows (at least `hidden`).
    pub row_stride: usize,
    /// Storage offset of the first element, in elements.
    pub offset: usize,
}

impl Rows {
    /// The row view of `meta`, or why there is none.
    pub fn of(meta: &TensorMeta) -> Result<Rows, Cow<'static, str>> {
        let layout = &meta.layout;
        let hidden = layout.last_dim();
        let last_stride = layout.strides().last().copied().unwrap_or(1);
        if hidden > 1 && last_stride != 1 {
            return Err(Cow::Owned(format!("last dimension has stride {last_stride}, kernels need 1")));
        }
        let Some((n_rows, row_stride)) = layout.as_rows() else {
            return Err(Cow::Owned(format!(
                "layout {} is not rows of one stride (strides {:?})",
                layout,
                layout.strides()
            )));
        };
        let row_stride = if n_rows <= 1 { hidden } else { row_stride };
        if row_stride < hidden {
            return Err(Cow::Owned(format!("row stride {row_stride} is smaller than the hidden size {hidden}")));
        }
        Ok(Rows { n_rows, hidden, row_stride, offset: layout.offset() })
    }

    /// The row view a kernel needs, as a kernel error when there is none (the predicate rejects such
    /// arguments, so this is a defensive check).
    pub fn for_kernel(meta: &TensorMeta) -> Result<Rows, KernelError> {
        Rows::of(meta).map_err(|reason| KernelError::InvalidArguments { reason: reason.into_owned() })
    }

    /// One past the last element the rows touch, relative to `offset`.
    pub fn span(&self) -> usize {
        match self.n_rows {
            0 => 0,
            n => (n - 1) * self.row_stride + self.hidden,
        }
    }
}

/// A tensor seen as `count` blocks of [`Rows`], one block stride apart: the heads of a column slice
/// (`q` of a merged qkv projection viewed `[tokens, heads, head_dim]`), whose rows are one stride
/// apart within a token and another between tokens, so they are not rows of one stride. Blocks may
/// overlap (a broadcast view): what reads them is fine with that, and nothing writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBlocks {
    /// The first block's rows (the second-to-last dimension, each row the last).
    pub rows: Rows,
    /// Number of blocks (product of the dimensions before the last two).
    pub count: usize,
    /// Elements between the starts of consecutive blocks.
    pub stride: usize,
}

impl RowBlocks {
    /// The row blocks of `meta`, or why there are none: rank 3 or more, a unit last stride, and
    /// the dimensions before the last two of one stride (their strides nest).
    pub fn of(meta: &TensorMeta) -> Result<RowBlocks, Cow<'static, str>> {
        let layout = &meta.layout;
        let (shape, strides) = (layout.shape(), layout.strides());
        let rank = shape.len();
        if rank < 3 {
            return Err(Cow::Borrowed("row blocks need rank 3 or more"));
        }
        let hidden = shape[rank - 1];
        if hidden > 1 && strides[rank - 1] != 1 {
            return Err(Cow::Owned(format!("last dimension has stride {}, kernels need 1", strides[rank - 1])));
        }
        let (n_rows, row_stride) = (shape[rank - 2], if shape[rank - 2] <= 1 { hidden } else { strides[rank - 2] });
        if row_stride < hidden {
            return Err(Cow::Owned(format!("row stride {row_stride} is smaller than the hidden size {hidden}")));
        }
        // The leading dimensions as one: each stride the next one's times its extent (extents of 1
        // do not count).
        let leading: Vec<(usize, usize)> = shape[..rank - 2]
            .iter()
            .zip(&strides[..rank - 2])
            .map(|(&n, &s)| (n, s))
            .filter(|&(n, _)| n != 1)
            .collect();
        let count = shape[..rank - 2].iter().product();
        let nested = leading.windows(2).all(|pair| pair[0].1 == pair[1].1 * pair[1].0);
        if !nested {
            return Err(Cow::Owned(format!("layout {layout} has leading dimensions of more than one stride")));
        }
        let stride = leading.last().map_or(0, |&(_, s)| s);
        Ok(RowBlocks { rows: Rows { n_rows, hidden, row_stride, offset: layout.offset() }, count, stride })
    }

    /// `meta`'s rows as blocks: rows of one stride as one block (of stride 0), else its row blocks
    /// (the heads of a column slice); the error is why `meta` is not rows of one stride.
    pub fn of_any(meta: &TensorMeta) -> Result<RowBlocks, Cow<'static, str>> {
        match Rows::of(meta) {
            Ok(rows) => Ok(RowBlocks { rows, count: 1, stride: 0 }),
            Err(why) => RowBlocks::of(meta).map_err(|_| why),
        }
    }

    /// Block `index`'s rows.
    pub fn block(&self, index: usize) -> Rows {
        Rows { offset: self.rows.offset + index * self.stride, ..self.rows }
    }

    /// One past the last element the blocks touch, relative to the first block's offset.
    pub fn span(&self) -> usize {
        match self.count {
            0 => 0,
            n => (n - 1) * self.stride + self.rows.span(),
        }
    }
}

/// [`Rows`] as a GPU kernel's integer parameters (`long long n_rows, int hidden, long long
/// row_stride`, and the storage offset for kernels that take it), each converted without loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowArgs {
    /// Number of rows.
    pub n_rows: i64,
    /// Elements per row.
    pub hidden: i32,
    /// Elements between row starts.
    pub row_stride: i64,
    /// Storage offset of the first element, in elements.
    pub offset: i64,
}

impl Rows {
    /// The rows as kernel parameters, or an error naming the one that does not fit ([`kernel_int`]).
    pub fn kernel_args(&self) -> Result<RowArgs, KernelError> {
        Ok(RowArgs {
            n_rows: kernel_int(self.n_rows, "rows")?,
            hidden: kernel_int(self.hidden, "hidden size")?,
            row_stride: kernel_int(self.row_stride, "row stride")?,
            offset: kernel_int(self.offset, "storage offset")?,
        })
    }
}

impl RowArgs {
    /// The rows these parameters were made from ([`Rows::kernel_args`]), for a host kernel handed a
    /// launch, so it need not derive them from the layout again; an error names a negative field.
    pub fn rows(&self) -> Result<Rows, KernelError> {
        let back =
            |value: i64, what: &'static str| usize::try_from(value).map_err(|_| out_of_range(what, value, 0, i64::MAX));
        Ok(Rows {
            n_rows: back(self.n_rows, "rows")?,
            hidden: back(self.hidden.into(), "hidden size")?,
            row_stride: back(self.row_stride, "row stride")?,
            offset: back(self.offset, "storage offset")?,
        })
    }
}

/// Kernels do not implement `variance_size`; a defensive check behind the predicate.
pub fn reject_variance_size(variance_size: Option<i64>) -> Result<(), KernelError> {
    match variance_size {
        None => Ok(()),
        Some(_) => Err(KernelError::NativeOnly { param: "variance_size" }),
    }
}

/// The elements of each row a norm's mean square runs over: `variance_size` (the meta function has
/// checked it lies in 1..=H; checked again here, as a kernel error), else the hidden size.
pub fn norm_variance(variance_size: Option<i64>, hidden: usize) -> Result<usize, KernelError> {
    match variance_size {
        None => Ok(hidden),
        Some(v) => usize::try_from(v)
            .ok()
            .filter(|&v| (1..=hidden).contains(&v))
            .ok_or_else(|| out_of_range("variance_size", v, 1, hidden)),
    }
}
