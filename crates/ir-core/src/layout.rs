//! Shapes, strides and storage offsets.
//!
//! Strides and offsets are in elements, not bytes. A layout is canonical: the stride of every dimension
//! of size 1 (and every stride of a layout without elements) is replaced by its row-major value, so
//! equal logical layouts compare, hash and print equal.

use smallvec::SmallVec;
use std::fmt;

/// Why a layout or view could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// Shape and strides have different lengths.
    #[error("shape {shape:?} has rank {} but strides {strides:?} have rank {}", shape.len(), strides.len())]
    RankMismatch {
        /// The shape given.
        shape: Vec<usize>,
        /// The strides given.
        strides: Vec<usize>,
    },
    /// A dimension index is out of range.
    #[error("dimension {dim} is out of range for rank {rank}")]
    DimOutOfRange {
        /// The dimension asked for.
        dim: usize,
        /// The rank of the layout.
        rank: usize,
    },
    /// A slice range does not fit the dimension.
    #[error("slice {start}..{end} is out of range for dimension {dim} of size {size}")]
    SliceOutOfRange {
        /// The dimension sliced.
        dim: usize,
        /// First index taken.
        start: usize,
        /// One past the last index taken.
        end: usize,
        /// Size of the dimension.
        size: usize,
    },
    /// A reshape to a different number of elements.
    #[error("cannot reshape shape {shape:?} ({}) to {target:?} ({})", element_count(shape), element_count(target))]
    NumelMismatch {
        /// The source shape.
        shape: Vec<usize>,
        /// The requested shape.
        target: Vec<usize>,
    },
    /// A reshape that no strides over the same storage can express.
    #[error(
        "cannot view shape {shape:?} with strides {strides:?} as {target:?} without a copy; use contiguous() first"
    )]
    NotViewable {
        /// The source shape.
        shape: Vec<usize>,
        /// The source strides.
        strides: Vec<usize>,
        /// The requested shape.
        target: Vec<usize>,
    },
    /// An index computation that does not fit in `usize`.
    #[error("layout with shape {shape:?} overflows the address space")]
    Overflow {
        /// The shape involved.
        shape: Vec<usize>,
    },
}

/// Dimensions kept inline up to rank 4 (every tensor of a norm), so metadata needs no heap.
type Dims = SmallVec<[usize; 4]>;

/// Shape, strides (elements) and storage offset (elements) of a tensor.
#[derive(Debug, Eq)]
pub struct Layout {
    shape: Dims,
    strides: Dims,
    offset: usize,
}

impl PartialEq for Layout {
    /// Compared element by element (dispatch compares layouts several times per call).
    #[inline]
    fn eq(&self, other: &Layout) -> bool {
        self.offset == other.offset && dims_eq(&self.shape, &other.shape) && dims_eq(&self.strides, &other.strides)
    }
}

impl std::hash::Hash for Layout {
    /// Hashes what [`PartialEq`] compares.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.shape[..].hash(state);
        self.strides[..].hash(state);
        self.offset.hash(state);
    }
}

/// Whether two dimension lists are equal, by an element loop: ranks are small, and the slice
/// comparison calls `memcmp`, which costs more than the comparison itself at these lengths.
#[inline]
pub(crate) fn dims_eq(a: &[usize], b: &[usize]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

impl Clone for Layout {
    /// A copy of the dimensions as one block each (`SmallVec`'s derived clone extends element by
    /// element; a layout is cloned with every tensor handle, so on every dispatched call).
    fn clone(&self) -> Layout {
        Layout { shape: Dims::from_slice(&self.shape), strides: Dims::from_slice(&self.strides), offset: self.offset }
    }
}

/// A shape's element count as an error names it: `N elements`, or that the count overflows.
fn element_count(shape: &[usize]) -> String {
    match shape.iter().try_fold(1usize, |acc, &size| acc.checked_mul(size)) {
        Some(count) => format!("{count} elements"),
        None => "an element count that overflows usize".to_owned(),
    }
}

/// The number of elements of a shape (1 for rank 0).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides of a shape.
pub fn compact_strides(shape: &[usize]) -> Vec<usize> {
    compact_dims(shape).into_vec()
}

fn compact_dims(shape: &[usize]) -> Dims {
    let mut strides: Dims = smallvec::smallvec![0; shape.len()];
    let mut acc = 1usize;
    for (stride, &size) in strides.iter_mut().zip(shape).rev() {
        *stride = acc;
        acc = acc.saturating_mul(size);
    }
    strides
}

impl Layout {
    /// A compact (row-major) layout at offset 0, or `Overflow` when the element count does not fit
    /// `usize` (for shapes from user input; [`Layout::compact`] is for shapes of existing layouts).
    pub fn try_compact(shape: &[usize]) -> Result<Layout, LayoutError> {
        Layout::new(shape, &compact_strides(shape), 0)
    }

    /// A compact (row-major) layout at offset 0. The caller guarantees that the element count fits
    /// `usize` (the shape of an existing layout does); use [`Layout::try_compact`] otherwise.
    pub fn compact(shape: &[usize]) -> Layout {
        Layout { shape: Dims::from_slice(shape), strides: compact_dims(shape), offset: 0 }
    }

    /// A layout from explicit strides and offset, canonicalized.
    pub fn new(shape: &[usize], strides: &[usize], offset: usize) -> Result<Layout, LayoutError> {
        if shape.len() != strides.len() {
            return Err(LayoutError::RankMismatch { shape: shape.to_vec(), strides: strides.to_vec() });
        }
        let overflow = || LayoutError::Overflow { shape: shape.to_vec() };
        let numel = shape.iter().try_fold(1usize, |acc, &size| acc.checked_mul(size)).ok_or_else(overflow)?;
        // One pass from the last dimension: `canonicalize` (a size-1 dimension, or every dimension
        // of an empty layout, takes its row-major stride) and `span_checked` (the last element's
        // index fits, and one past it), as every candle call makes its layouts here.
        let mut canonical = Dims::from_slice(strides);
        let mut row_major = 1usize;
        let mut last = offset;
        for (stride, &size) in canonical.iter_mut().zip(shape).rev() {
            if numel == 0 || size == 1 {
                *stride = row_major;
            } else {
                last = (size - 1).checked_mul(*stride).and_then(|step| last.checked_add(step)).ok_or_else(overflow)?;
            }
            row_major = row_major.saturating_mul(size);
        }
        if numel != 0 && last.checked_add(1).is_none() {
            return Err(overflow());
        }
        Ok(Layout { shape: Dims::from_slice(shape), strides: canonical, offset })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The storage offset, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Size of the last dimension (1 for rank 0).
    pub fn last_dim(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// One past the largest storage index this layout touches (0 without elements).
    pub fn storage_end(&self) -> usize {
        self.span_checked().expect("checked when the layout was built")
    }

    /// Whether the strides are the row-major strides of the shape.
    pub fn is_compact(&self) -> bool {
        let mut acc = 1usize;
        for (&stride, &size) in self.strides.iter().zip(&self.shape).rev() {
            if stride != acc {
                return false;
            }
            acc = acc.saturating_mul(size);
        }
        true
    }

    /// Whether this is exactly `Layout::compact(shape)`: compact strides and offset 0.
    pub fn is_compact_at_zero(&self) -> bool {
        self.offset == 0 && self.is_compact()
    }

    /// Whether the elements occupy exactly `numel` consecutive slots (compact in some dimension order).
    pub fn is_dense(&self) -> bool {
        if self.numel() == 0 || self.is_compact() {
            return true;
        }
        let mut expected = 1usize;
        for (stride, size) in self.dims_by_stride() {
            if stride != expected {
                return false;
            }
            expected *= size;
        }
        true
    }

    /// Whether two elements of this layout sit at one storage index, so that writing through it
    /// would lose all but one of them (a broadcast view: a dimension of stride 0 over several
    /// elements; or strides that interleave onto each other). Exact. Compact layouts, and layouts
    /// whose dimensions sorted by stride each step past the span of the smaller ones, answer at
    /// once; other interleaved strides (rare) are answered by listing the indices. Should memory
    /// for that list be refused, the answer is `true`: the caller refuses rather than guess.
    pub fn overlaps_itself(&self) -> bool {
        if self.numel() == 0 || self.is_compact() {
            return false;
        }
        let dims = self.dims_by_stride();
        if dims.first().is_some_and(|&(stride, _)| stride == 0) {
            return true;
        }
        // The largest index offset the smaller dimensions reach (it fits: the layout's span does).
        let mut span = 0usize;
        let proven_apart = dims.iter().all(|&(stride, size)| {
            let apart = stride > span;
            span += (size - 1) * stride;
            apart
        });
        if proven_apart {
            return false;
        }
        match self.sorted_indices() {
            Some(indices) => indices.windows(2).any(|pair| pair[0] == pair[1]),
            None => true,
        }
    }

    /// Whether this layout and `other` (two views of one storage) have an element at a common
    /// storage index. Exact: [`Layout::disjoint_from`] answers the usual views at once, the rest by
    /// listing the smaller layout's indices (`true` should memory for that list be refused).
    pub fn shares_element_with(&self, other: &Layout) -> bool {
        if self.disjoint_from(other) {
            return false;
        }
        let (small, large) = if self.numel() <= other.numel() { (self, other) } else { (other, self) };
        match small.sorted_indices() {
            Some(indices) => large.storage_indices().any(|index| indices.binary_search(&index).is_ok()),
            None => true,
        }
    }

    /// Every storage index of this layout, sorted (duplicates kept); `None` when the allocator
    /// refuses the list.
    fn sorted_indices(&self) -> Option<Vec<usize>> {
        let mut indices = Vec::new();
        indices.try_reserve_exact(self.numel()).ok()?;
        indices.extend(self.storage_indices());
        indices.sort_unstable();
        Some(indices)
    }

    /// The `(stride, size)` of each dimension of more than one element, by increasing stride.
    fn dims_by_stride(&self) -> SmallVec<[(usize, usize); 4]> {
        let mut dims: SmallVec<[(usize, usize); 4]> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(size, _)| **size > 1)
            .map(|(&size, &stride)| (stride, size))
            .collect();
        dims.sort_unstable();
        dims
    }

    /// The layout a copy of this layout gets: the same strides at offset 0 when dense, else compact.
    pub fn copy_layout(&self) -> Layout {
        if self.is_dense() {
            Layout { shape: self.shape.clone(), strides: self.strides.clone(), offset: 0 }
        } else {
            Layout::compact(&self.shape)
        }
    }

    /// Whether no element of this layout and of `other` (two views of one storage) is at the same
    /// storage index. A sufficient test, exact for the cases views of one buffer give: the two
    /// index ranges do not overlap, or both layouts are rows of one stride `S` (the largest stride
    /// of each, every other dimension inside one row) whose column ranges within a row do not
    /// overlap (column slices of one `qkv` buffer, heads split or not). `false` means they may
    /// overlap.
    pub fn disjoint_from(&self, other: &Layout) -> bool {
        if self.numel() == 0 || other.numel() == 0 {
            return true;
        }
        let (a_end, b_end) = (self.storage_end(), other.storage_end());
        if a_end <= other.offset || b_end <= self.offset {
            return true;
        }
        // Each layout's own row stride, tried for both.
        let rows = [self.row_columns(None), other.row_columns(None)].map(|r| r.map(|(row, _)| row));
        rows.into_iter().flatten().any(|row| match (self.row_columns(Some(row)), other.row_columns(Some(row))) {
            (Some((_, a)), Some((_, b))) => a.1 <= b.0 || b.1 <= a.0,
            _ => false,
        })
    }

    /// This layout as rows of stride `S` (its largest stride among dimensions of more than one
    /// element, or `row` when given): `(S, columns)`, the half-open range of indices modulo `S` its
    /// elements take, when that range fits inside one row and exactly one dimension has stride `S`.
    /// A layout of one element (or whose dimensions all fit in a row) takes `row` as given.
    fn row_columns(&self, row: Option<usize>) -> Option<(usize, (usize, usize))> {
        let dims = || self.shape.iter().zip(&self.strides).filter(|(size, _)| **size > 1);
        let row = match row {
            Some(row) => row,
            None => dims().map(|(_, &stride)| stride).max()?,
        };
        if row == 0 {
            return None;
        }
        let mut outer = 0;
        let mut inner_span = 0usize;
        for (&size, &stride) in dims() {
            if stride == row {
                outer += 1;
            } else {
                inner_span = inner_span.checked_add((size - 1).checked_mul(stride)?)?;
            }
        }
        let start = self.offset % row;
        let end = start.checked_add(inner_span)?.checked_add(1)?;
        (outer <= 1 && end <= row).then_some((row, (start, end)))
    }

    /// The same shape and strides at another storage offset (`Overflow` when the span no longer fits).
    pub fn with_offset(&self, offset: usize) -> Result<Layout, LayoutError> {
        Layout::new(&self.shape, &self.strides, offset)
    }

    /// A view of `start..end` along `dim`.
    pub fn slice(&self, dim: usize, start: usize, end: usize) -> Result<Layout, LayoutError> {
        self.check_dim(dim)?;
        let size = self.shape[dim];
        if start > end || end > size {
            return Err(LayoutError::SliceOutOfRange { dim, start, end, size });
        }
        let mut shape = self.shape.clone();
        shape[dim] = end - start;
        // In range: start < size, and (size - 1) * stride + offset fits (checked when built).
        let offset = if end > start { self.offset + start * self.strides[dim] } else { self.offset };
        Layout::new(&shape, &self.strides, offset)
    }

    /// A view of `len` indices from `start` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout, LayoutError> {
        let end = start.checked_add(len).ok_or_else(|| LayoutError::Overflow { shape: self.shape.to_vec() })?;
        self.slice(dim, start, end)
    }

    /// A view with dimensions `d0` and `d1` swapped.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Layout, LayoutError> {
        self.check_dim(d0)?;
        self.check_dim(d1)?;
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.swap(d0, d1);
        strides.swap(d0, d1);
        Layout::new(&shape, &strides, self.offset)
    }

    /// A view with another shape of the same number of elements, when strides can express it.
    pub fn reshape(&self, target: &[usize]) -> Result<Layout, LayoutError> {
        let target_numel = target.iter().try_fold(1usize, |acc, &size| acc.checked_mul(size));
        if target_numel != Some(self.numel()) {
            return Err(LayoutError::NumelMismatch { shape: self.shape.to_vec(), target: target.to_vec() });
        }
        if self.numel() == 0 {
            return Layout::new(target, &compact_strides(target), self.offset);
        }
        match self.view_strides(target) {
            Some(strides) => Layout::new(target, &strides, self.offset),
            None => Err(LayoutError::NotViewable {
                shape: self.shape.to_vec(),
                strides: self.strides.to_vec(),
                target: target.to_vec(),
            }),
        }
    }

    /// Iterates the storage index of every element in logical (row-major) order.
    pub fn storage_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.numel();
        let rank = self.rank();
        let mut index = vec![0usize; rank];
        let mut position = self.offset;
        (0..n).map(move |i| {
            if i > 0 {
                // Advance the multi-index like an odometer, updating the storage position incrementally.
                for dim in (0..rank).rev() {
                    index[dim] += 1;
                    position += self.strides[dim];
                    if index[dim] < self.shape[dim] {
                        break;
                    }
                    position -= self.strides[dim] * self.shape[dim];
                    index[dim] = 0;
                }
            }
            position
        })
    }

    /// Views the layout as `n_rows` rows of `last_dim` elements with one row stride, if possible.
    ///
    /// Returns `(n_rows, row_stride)`. Leading dimensions must collapse into one stride.
    pub fn as_rows(&self) -> Option<(usize, usize)> {
        let rank = self.rank();
        if rank == 0 {
            return Some((1, 1));
        }
        let n_rows = numel(&self.shape[..rank - 1]);
        if n_rows <= 1 {
            return Some((n_rows, self.last_dim()));
        }
        // Collapse the leading dimensions: each (skipping size-1 ones) must step by size * inner stride.
        let mut row_stride = None;
        let mut expected = None;
        for dim in (0..rank - 1).rev() {
            let size = self.shape[dim];
            if size == 1 {
                continue;
            }
            let stride = self.strides[dim];
            match expected {
                None => row_stride = Some(stride),
                Some(expected) if expected == stride => {}
                Some(_) => return None,
            }
            expected = Some(stride * size);
        }
        row_stride.map(|row_stride| (n_rows, row_stride))
    }

    fn check_dim(&self, dim: usize) -> Result<(), LayoutError> {
        if dim < self.rank() {
            return Ok(());
        }
        Err(LayoutError::DimOutOfRange { dim, rank: self.rank() })
    }

    fn span_checked(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(0);
        }
        let mut last = self.offset;
        for (&size, &stride) in self.shape.iter().zip(&self.strides) {
            last = last.checked_add((size - 1).checked_mul(stride)?)?;
        }
        last.checked_add(1)
    }

    /// Strides viewing this layout's elements as `target`, following the usual chunk-matching rule:
    /// each group of source dimensions that is contiguous with itself maps onto a group of target
    /// dimensions of the same element count.
    fn view_strides(&self, target: &[usize]) -> Option<Dims> {
        let mut new_strides: Dims = smallvec::smallvec![0usize; target.len()];
        let mut view_d = target.len() as isize - 1;
        let mut chunk_base_stride = *self.strides.last().unwrap_or(&1);
        let mut tensor_numel = 1usize;
        let mut view_numel = 1usize;
        for tensor_d in (0..self.rank()).rev() {
            tensor_numel *= self.shape[tensor_d];
            let chunk_ends = tensor_d == 0
                || (self.shape[tensor_d - 1] != 1 && self.strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || target[view_d as usize] == 1) {
                    new_strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= target[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = self.strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(new_strides)
    }
}

impl fmt::Display for Layout {
    /// Prints `[8,16]`, plus `{16,1}` when not compact and `+5` when the offset is not 0.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, "[", &self.shape, "]")?;
        if !self.is_compact() {
            write_list(f, "{", &self.strides, "}")?;
        }
        if self.offset != 0 {
            write!(f, "+{}", self.offset)?;
        }
        Ok(())
    }
}

fn write_list(f: &mut fmt::Formatter<'_>, open: &str, items: &[usize], close: &str) -> fmt::Result {
    f.write_str(open)?;
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(",")?;
        }
        write!(f, "{item}")?;
    }
    f.write_str(close)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column slices of one `[T, 64]` qkv buffer, flat or with heads split, are told apart; views
    /// that share an element never are.
    #[test]
    fn column_slices_of_one_buffer_are_disjoint_and_overlapping_views_are_not() {
        let qkv = Layout::compact(&[4, 64]);
        let q = qkv.slice(1, 0, 32).unwrap();
        let k = qkv.slice(1, 32, 48).unwrap();
        let v = qkv.slice(1, 48, 64).unwrap();
        let q_heads = q.reshape(&[4, 2, 16]).unwrap();
        let k_heads = k.reshape(&[4, 1, 16]).unwrap();
        for (a, b) in [(&q, &k), (&k, &v), (&q, &v), (&q_heads, &k_heads), (&q_heads, &v)] {
            assert!(a.disjoint_from(b) && b.disjoint_from(a), "{a:?} and {b:?}");
        }
        let row = qkv.slice(0, 1, 2).unwrap().slice(1, 40, 48).unwrap();
        assert!(row.disjoint_from(&q), "one row of k's columns is apart from q");
        let overlapping = qkv.slice(1, 24, 40).unwrap();
        let transposed = Layout::compact(&[64, 4]).transpose(0, 1).unwrap();
        for (a, b) in [(&q, &overlapping), (&k, &overlapping), (&qkv, &q), (&transposed, &q), (&q, &q)] {
            assert!(!a.disjoint_from(b) && !b.disjoint_from(a), "{a:?} and {b:?}");
        }
        assert!(Layout::compact(&[0, 8]).disjoint_from(&qkv), "no elements");
    }

    proptest::proptest! {
        /// Never wrong: layouts said to be disjoint share no storage index.
        #[test]
        fn disjoint_layouts_share_no_element(
            a in proptest::collection::vec((1usize..4, 0usize..40), 1..4),
            b in proptest::collection::vec((1usize..4, 0usize..40), 1..4),
            offsets in (0usize..80, 0usize..80),
        ) {
            let layout = |dims: &[(usize, usize)], offset| {
                let (shape, strides): (Vec<usize>, Vec<usize>) = dims.iter().copied().unzip();
                Layout::new(&shape, &strides, offset).unwrap()
            };
            let (a, b) = (layout(&a, offsets.0), layout(&b, offsets.1));
            if a.disjoint_from(&b) {
                let elements: std::collections::HashSet<usize> = a.storage_indices().collect();
                proptest::prop_assert!(b.storage_indices().all(|i| !elements.contains(&i)), "{:?} {:?}", a, b);
            }
        }
    }

    /// A reshape to a shape whose element count overflows says so instead of a wrapped count.
    #[test]
    fn an_overflowing_element_count_is_named() {
        let target = [2305843009213693953usize, 8];
        let error = LayoutError::NumelMismatch { shape: vec![2, 4], target: target.to_vec() };
        assert_eq!(
            error.to_string(),
            "cannot reshape shape [2, 4] (8 elements) to [2305843009213693953, 8] (an element count that overflows usize)"
        );
    }

    /// Broadcast views and strides that interleave onto each other overlap themselves; compact
    /// layouts, slices, transposes, padded rows and strides that interleave without meeting do not.
    #[test]
    fn broadcast_views_overlap_themselves_and_slices_do_not() {
        let broadcast = Layout::new(&[4, 8], &[0, 1], 0).unwrap();
        let interleaved = Layout::new(&[3, 4], &[2, 1], 0).unwrap();
        for layout in [&broadcast, &interleaved] {
            assert!(layout.overlaps_itself(), "{layout:?}");
        }
        let padded = Layout::new(&[4, 8], &[24, 1], 3).unwrap();
        let transposed = Layout::compact(&[8, 4]).transpose(0, 1).unwrap();
        let one_row = Layout::new(&[1, 8], &[0, 1], 0).unwrap();
        // Indices {0, 2, 4} + {0, 3}: interleaved, yet every element has its own.
        let interleaved_apart = Layout::new(&[3, 2], &[2, 3], 0).unwrap();
        for layout in
            [&Layout::compact(&[4, 8]), &padded, &transposed, &one_row, &Layout::compact(&[0, 8]), &interleaved_apart]
        {
            assert!(!layout.overlaps_itself(), "{layout:?}");
        }
        // Even and odd columns of one buffer share no element; a column shared by two views does.
        let even = Layout::new(&[4, 4], &[8, 2], 0).unwrap();
        let odd = Layout::new(&[4, 4], &[8, 2], 1).unwrap();
        assert!(!even.shares_element_with(&odd) && !odd.shares_element_with(&even));
        let shifted = Layout::new(&[4, 4], &[8, 2], 2).unwrap();
        assert!(even.shares_element_with(&shifted));
    }

    proptest::proptest! {
        /// Exact: a layout overlaps itself exactly when two of its elements share an index, and
        /// two layouts share an element exactly when their index sets meet.
        #[test]
        fn overlap_answers_are_exact(
            a in proptest::collection::vec((1usize..4, 0usize..12), 1..4),
            b in proptest::collection::vec((1usize..4, 0usize..12), 1..4),
            offsets in (0usize..20, 0usize..20),
        ) {
            let layout = |dims: &[(usize, usize)], offset| {
                let (shape, strides): (Vec<usize>, Vec<usize>) = dims.iter().copied().unzip();
                Layout::new(&shape, &strides, offset).unwrap()
            };
            let (a, b) = (layout(&a, offsets.0), layout(&b, offsets.1));
            let indices: Vec<usize> = a.storage_indices().collect();
            let distinct: std::collections::HashSet<usize> = indices.iter().copied().collect();
            proptest::prop_assert_eq!(a.overlaps_itself(), distinct.len() != indices.len(), "{:?}", a);
            let meet = b.storage_indices().any(|i| distinct.contains(&i));
            proptest::prop_assert_eq!(a.shares_element_with(&b), meet, "{:?} {:?}", a, b);
        }
    }

    proptest::proptest! {
        /// `Layout::new` in its one pass is the definition: size-1 dimensions (every dimension of
        /// an empty layout) take their row-major strides, and the layout is refused exactly when
        /// its element count or one past its last element's index overflows.
        #[test]
        fn new_canonicalizes_and_checks_the_span_as_defined(
            dims in proptest::collection::vec((0usize..4, 0usize..(1 << 20)), 0..5),
            huge in proptest::bool::ANY,
            offset in 0usize..64,
        ) {
            let (mut shape, mut strides): (Vec<usize>, Vec<usize>) = dims.iter().copied().unzip();
            if huge && !strides.is_empty() {
                strides[0] = usize::MAX / 2;
                shape[0] = shape[0].max(3);
            }
            let numel = shape.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s));
            let mut canonical = strides.clone();
            let mut row_major = 1usize;
            for (stride, &size) in canonical.iter_mut().zip(&shape).rev() {
                if numel == Some(0) || size == 1 {
                    *stride = row_major;
                }
                row_major = row_major.saturating_mul(size);
            }
            let span = match numel {
                None => None,
                Some(0) => Some(0),
                Some(_) => shape
                    .iter()
                    .zip(&canonical)
                    .try_fold(offset, |last, (&size, &stride)| (size - 1).checked_mul(stride).and_then(|s| last.checked_add(s)))
                    .and_then(|last| last.checked_add(1)),
            };
            match Layout::new(&shape, &strides, offset) {
                Ok(layout) => {
                    proptest::prop_assert!(span.is_some(), "{:?} {:?}", shape, strides);
                    proptest::prop_assert_eq!(layout.strides(), canonical.as_slice());
                    proptest::prop_assert_eq!(layout.shape(), shape.as_slice());
                }
                Err(error) => {
                    proptest::prop_assert!(span.is_none(), "{:?} {:?}: {}", shape, strides, error);
                }
            }
        }
    }

    #[test]
    fn a_clone_is_the_same_layout_inline_and_spilled() {
        for layout in [
            Layout::compact(&[]),
            Layout::new(&[3, 5], &[10, 1], 7).unwrap(),
            Layout::new(&[2, 3, 4, 5, 6, 7], &[5040, 1680, 420, 84, 14, 2], 3).unwrap(),
        ] {
            let copy = layout.clone();
            assert_eq!(copy, layout);
            assert_eq!(
                (copy.shape(), copy.strides(), copy.offset()),
                (layout.shape(), layout.strides(), layout.offset())
            );
        }
    }

    #[test]
    fn layouts_are_equal_exactly_when_shape_strides_and_offset_are_and_then_hash_alike() {
        use std::hash::{BuildHasher, RandomState};
        let layouts = [
            Layout::compact(&[]),
            Layout::compact(&[4096]),
            Layout::compact(&[1, 4096]),
            Layout::new(&[2, 4096], &[8192, 1], 0).unwrap(),
            Layout::compact(&[2, 4096]),
            Layout::new(&[1, 4096], &[4096, 1], 1).unwrap(),
            Layout::compact(&[4096, 1]),
            Layout::compact(&[2, 3, 4, 5, 6]),
            Layout::compact(&[2, 3, 4, 5, 7]),
            Layout::compact(&[2, 3, 4, 5]),
        ];
        let hasher = RandomState::new();
        for (i, a) in layouts.iter().enumerate() {
            for (j, b) in layouts.iter().enumerate() {
                let same = (a.shape(), a.strides(), a.offset()) == (b.shape(), b.strides(), b.offset());
                assert_eq!(a == b, same, "{a} vs {b}");
                assert_eq!(i == j, same, "the list holds distinct layouts");
            }
            assert_eq!(hasher.hash_one(a), hasher.hash_one(a.clone()), "{a}");
        }
    }

    #[test]
    fn sizes_never_wrap() {
        let huge = 1usize << 40;
        assert!(matches!(Layout::try_compact(&[huge, huge]), Err(LayoutError::Overflow { .. })));
        assert!(matches!(Layout::new(&[2], &[1], usize::MAX), Err(LayoutError::Overflow { .. })));
        let small = Layout::compact(&[4]);
        assert!(matches!(small.with_offset(usize::MAX - 1), Err(LayoutError::Overflow { .. })));
        assert_eq!(small.with_offset(3).unwrap().storage_end(), 7);
        // The target's product wraps to 4 in 64 bits; it must not be mistaken for 4 elements.
        let wrapping = [1usize << 32, 1 << 32, 4];
        assert!(matches!(small.reshape(&wrapping), Err(LayoutError::NumelMismatch { .. })));
    }

    #[test]
    fn canonical_strides_for_size_one_dims() {
        let row = Layout::new(&[1, 4096], &[8192, 1], 0).unwrap();
        assert!(row.is_compact());
        assert_eq!(row, Layout::compact(&[1, 4096]));
        let empty = Layout::new(&[0, 4], &[100, 7], 3).unwrap();
        assert_eq!(empty.strides(), &[4, 1]);
        assert_eq!(empty.storage_end(), 0);
    }

    #[test]
    fn compact_and_dense() {
        let base = Layout::compact(&[4, 5]);
        assert!(base.is_compact() && base.is_dense());
        let transposed = base.transpose(0, 1).unwrap();
        assert!(!transposed.is_compact() && transposed.is_dense());
        let columns = base.slice(1, 0, 3).unwrap();
        assert_eq!(columns.strides(), &[5, 1]);
        assert!(!columns.is_dense());
        assert_eq!(columns.copy_layout().strides(), &[3, 1]);
        let rows = base.slice(0, 1, 4).unwrap();
        assert_eq!(rows.offset(), 5);
        assert!(rows.is_compact());
        assert_eq!(rows.copy_layout().offset(), 0);
        assert_eq!(transposed.copy_layout().strides(), &[1, 5]);
    }

    #[test]
    fn slice_errors() {
        let base = Layout::compact(&[4, 5]);
        assert_eq!(base.slice(2, 0, 1), Err(LayoutError::DimOutOfRange { dim: 2, rank: 2 }));
        assert_eq!(base.slice(1, 2, 6), Err(LayoutError::SliceOutOfRange { dim: 1, start: 2, end: 6, size: 5 }));
        assert!(base.slice(1, 3, 2).is_err());
    }

    #[test]
    fn reshape_views_and_refusals() {
        let base = Layout::compact(&[3, 8, 16]);
        let q = base.slice(0, 0, 1).unwrap().reshape(&[8, 16]).unwrap();
        assert_eq!(q, Layout::compact(&[8, 16]));
        let k = base.slice(0, 1, 2).unwrap().reshape(&[8, 16]).unwrap();
        assert_eq!(k.offset(), 128);
        let split = Layout::compact(&[8, 16]).reshape(&[8, 2, 8]).unwrap();
        assert_eq!(split.strides(), &[16, 8, 1]);
        let padded = Layout::compact(&[4, 5]).slice(1, 0, 3).unwrap();
        let flat = padded.reshape(&[12]);
        assert!(matches!(flat, Err(LayoutError::NotViewable { .. })), "{flat:?}");
        let split_rows = padded.reshape(&[2, 2, 3]).unwrap();
        assert_eq!(split_rows.strides(), &[10, 5, 1]);
        assert!(matches!(base.reshape(&[5]), Err(LayoutError::NumelMismatch { .. })));
        let transposed = Layout::compact(&[4, 6]).transpose(0, 1).unwrap();
        assert!(transposed.reshape(&[24]).is_err());
        assert_eq!(transposed.reshape(&[6, 2, 2]).unwrap().strides(), &[1, 12, 6]);
    }

    #[test]
    fn storage_indices_and_rows() {
        let padded = Layout::new(&[2, 3], &[5, 1], 1).unwrap();
        assert_eq!(padded.storage_indices().collect::<Vec<_>>(), vec![1, 2, 3, 6, 7, 8]);
        assert_eq!(padded.as_rows(), Some((2, 5)));
        let heads = Layout::compact(&[4, 2, 64]);
        assert_eq!(heads.as_rows(), Some((8, 64)));
        let q_of_qkv = Layout::compact(&[4, 3, 64]).slice(1, 0, 1).unwrap();
        assert_eq!(q_of_qkv.as_rows(), Some((4, 192)));
        let q_heads = Layout::compact(&[4, 3, 2, 64]).slice(1, 0, 1).unwrap();
        assert_eq!(q_heads.as_rows(), None);
        let k_of_qkv = Layout::compact(&[4, 3, 64]).slice(1, 1, 3).unwrap();
        assert_eq!(k_of_qkv.as_rows(), None);
        assert_eq!(Layout::compact(&[]).as_rows(), Some((1, 1)));
        assert_eq!(Layout::compact(&[0, 8]).as_rows(), Some((0, 8)));
    }

    #[test]
    fn display_is_text_format_type_syntax() {
        assert_eq!(Layout::compact(&[8, 16]).to_string(), "[8,16]");
        assert_eq!(Layout::new(&[8, 8], &[16, 1], 5).unwrap().to_string(), "[8,8]{16,1}+5");
        assert_eq!(Layout::compact(&[]).to_string(), "[]");
    }
}
