//! Devices a tensor can live on.

use std::fmt;
use std::str::FromStr;

/// Where a tensor's storage lives. The index selects one device of that kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// An NVIDIA GPU.
    Cuda(u32),
    /// An AMD GPU.
    Rocm(u32),
    /// An Intel GPU (OpenCL).
    Xpu(u32),
}

/// The kind of a [`Device`], without its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
    /// AMD GPUs.
    Rocm,
    /// Intel GPUs.
    Xpu,
}

/// A device spelling that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown device `{0}` (expected cpu, cuda:N, rocm:N or xpu:N)")]
pub struct UnknownDevice(pub String);

impl Device {
    /// The kind of this device.
    pub fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
            Device::Rocm(_) => DeviceKind::Rocm,
            Device::Xpu(_) => DeviceKind::Xpu,
        }
    }

    /// Whether this is host memory.
    pub fn is_cpu(self) -> bool {
        self == Device::Cpu
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(index) => write!(f, "cuda:{index}"),
            Device::Rocm(index) => write!(f, "rocm:{index}"),
            Device::Xpu(index) => write!(f, "xpu:{index}"),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Rocm => "rocm",
            DeviceKind::Xpu => "xpu",
        })
    }
}

impl FromStr for Device {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Device, UnknownDevice> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        let unknown = || UnknownDevice(s.to_owned());
        let (kind, index) = s.split_once(':').ok_or_else(unknown)?;
        let index: u32 = index.parse().map_err(|_| unknown())?;
        match kind {
            "cuda" => Ok(Device::Cuda(index)),
            "rocm" => Ok(Device::Rocm(index)),
            "xpu" => Ok(Device::Xpu(index)),
            _ => Err(unknown()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_parse() {
        for (device, text) in
            [(Device::Cpu, "cpu"), (Device::Cuda(0), "cuda:0"), (Device::Rocm(1), "rocm:1"), (Device::Xpu(0), "xpu:0")]
        {
            assert_eq!(device.to_string(), text);
            assert_eq!(text.parse::<Device>(), Ok(device));
        }
        for bad in ["gpu", "cuda", "cuda:x", "tpu:0", ""] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }
}
