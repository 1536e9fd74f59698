//! Kernel arguments: integers checked into the width a kernel takes, and a device provider's own
//! buffer behind a tensor.

use ir_core::storage::Storage;
use ir_core::{KernelError, Tensor, UniqueTensor};

/// Converts a size, stride or offset for a kernel's integer parameter (`hidden` is an `int`,
/// rows, strides and offsets are 64-bit), or names the one that does not fit. GPU predicates reject
/// a hidden size past `i32::MAX`; every element index fits `i64` because no tensor exceeds
/// `isize::MAX` bytes. This check keeps a launch from truncating either silently.
pub fn kernel_int<T: TryFrom<usize> + Bounded>(value: usize, what: &'static str) -> Result<T, KernelError> {
    T::try_from(value).map_err(|_| out_of_range(what, value, T::MIN_I128, T::MAX_I128))
}

/// An extent a GPU kernel walks with a 32-bit index in steps of `step` threads (`for (int j =
/// tid; j < n; j += step)`, the gated and quantization rows): it must fit `int` with room for the
/// last step, so the index never passes `i32::MAX` (which would wrap it negative and loop or write
/// out of bounds); else an error naming `what`.
pub fn stepped_extent(value: usize, what: &'static str, step: u32) -> Result<i32, KernelError> {
    let max = i32::MAX - i32::try_from(step).unwrap_or(i32::MAX);
    i32::try_from(value).ok().filter(|&v| v <= max).ok_or_else(|| out_of_range(what, value, 0, max))
}

/// The bounds of a kernel's integer parameter type, for [`kernel_int`]'s error.
pub trait Bounded {
    /// The least value.
    const MIN_I128: i128;
    /// The greatest value.
    const MAX_I128: i128;
}

macro_rules! bounded {
    ($($t:ty),+) => {$(
        impl Bounded for $t {
            const MIN_I128: i128 = <$t>::MIN as i128;
            const MAX_I128: i128 = <$t>::MAX as i128;
        }
    )+};
}
bounded!(i32, u32, i64, u64, usize);

/// [`KernelError::OutOfRange`] for `value` of `what` outside `min..=max` (each saturated to the
/// `i64` range).
pub fn out_of_range(
    what: &'static str,
    value: impl TryInto<i128>,
    min: impl TryInto<i128>,
    max: impl TryInto<i128>,
) -> KernelError {
    let saturate = |v: Option<i128>, missing: i128| v.unwrap_or(missing).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
    KernelError::OutOfRange {
        what,
        value: saturate(value.try_into().ok(), i128::MAX),
        min: saturate(min.try_into().ok(), i128::MIN),
        max: saturate(max.try_into().ok(), i128::MAX),
    }
}

/// A device provider's own buffer type behind `t`, or an error naming the parameter: "`x` is not in
/// CUDA memory" (`memory` names the provider's memory).
pub fn device_buffer<'t, B: 'static>(t: &'t Tensor, param: &str, memory: &'static str) -> Result<&'t B, KernelError> {
    match t.storage() {
        Storage::Device(buffer) => buffer.as_any().downcast_ref::<B>(),
        Storage::Cpu(_) => None,
    }
    .ok_or_else(|| not_in_memory(param, memory))
}

/// [`device_buffer`] for writing, through the unique ownership an in-place kernel receives.
pub fn device_buffer_mut<'t, B: 'static>(
    t: &'t mut UniqueTensor,
    param: &str,
    memory: &'static str,
) -> Result<&'t mut B, KernelError> {
    match t.storage_mut()? {
        Storage::Device(buffer) => buffer.as_any_mut().downcast_mut::<B>().ok_or_else(|| not_in_memory(param, memory)),
        Storage::Cpu(_) => Err(not_in_memory(param, memory)),
    }
}

fn not_in_memory(param: &str, memory: &'static str) -> KernelError {
    KernelError::WrongMemory { param: param.to_owned(), memory }
}
