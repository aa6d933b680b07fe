//! Where memory lives: [`Device`] and [`DeviceKind`], printed and parsed exactly as Python's
//! `dynamo.nixl_connect.Device` (`cpu`, `cuda:0`, `xpu:1`).

use std::fmt;
use std::str::FromStr;

use crate::sync::label_enum;

label_enum! {
/// The kind of memory a descriptor points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceKind {
    /// System (CPU) memory; NIXL's `DRAM`.
    Host => "cpu",
    /// CUDA device memory; NIXL's `VRAM`.
    Cuda => "cuda",
    /// Intel XPU device memory; NIXL's `VRAM`. Parsed for compatibility, not moved by this crate.
    Xpu => "xpu",
}
}

/// A device: host memory or one GPU.
///
/// ```
/// use nixl_connect::Device;
/// assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Cuda(1));
/// assert_eq!(Device::Host.to_string(), "cpu");
/// assert_eq!(" CUDA ".parse::<Device>().unwrap().to_string(), "cuda:0");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// Host memory (`cpu`).
    #[default]
    Host,
    /// CUDA device `n` (`cuda:n`).
    Cuda(u32),
    /// Intel XPU `n` (`xpu:n`).
    Xpu(u32),
}

impl Device {
    /// The kind of this device.
    pub fn kind(self) -> DeviceKind {
        match self {
            Device::Host => DeviceKind::Host,
            Device::Cuda(_) => DeviceKind::Cuda,
            Device::Xpu(_) => DeviceKind::Xpu,
        }
    }

    /// The device ordinal (0 for host memory).
    pub fn id(self) -> u32 {
        match self {
            Device::Host => 0,
            Device::Cuda(n) | Device::Xpu(n) => n,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("cpu"),
            d => write!(f, "{}:{}", d.kind(), d.id()),
        }
    }
}

/// A device string that is not `cpu`, `cuda[:N]` or `xpu[:N]` (becomes
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) with `?`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device {input:?} is not one of 'cpu', 'cuda:<device_id>', or 'xpu:<device_id>'")]
pub struct ParseDeviceError {
    /// The string as given.
    pub input: String,
}

impl FromStr for Device {
    type Err = ParseDeviceError;

    /// Parses as Python does: trimmed, case-insensitive; `cpu`, `cuda[:N]`, `xpu[:N]`.
    ///
    /// Python's `Device` also takes `host...` and `gpu...`, but its `SerializedDescriptor` accepts
    /// only `cpu`, `cuda...` and `xpu...`; this parser follows the stricter wire rule.
    fn from_str(s: &str) -> Result<Self, ParseDeviceError> {
        if s == "cpu" {
            return Ok(Device::Host); // every host descriptor of a metadata: no allocation
        }
        let v = s.trim().to_ascii_lowercase();
        let bad = || ParseDeviceError { input: s.to_string() };
        let ordinal = |rest: &str| -> Result<u32, ParseDeviceError> {
            match rest {
                "" => Ok(0),
                r => r
                    .strip_prefix(':')
                    .and_then(|n| n.parse::<u32>().ok())
                    .ok_or_else(bad),
            }
        };
        if v == "cpu" {
            Ok(Device::Host)
        } else if let Some(rest) = v.strip_prefix("cuda") {
            Ok(Device::Cuda(ordinal(rest)?))
        } else if let Some(rest) = v.strip_prefix("xpu") {
            Ok(Device::Xpu(ordinal(rest)?))
        } else {
            Err(bad())
        }
    }
}

impl serde::Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse()
            .map_err(|e: ParseDeviceError| serde::de::Error::custom(format!("device: {e}")))
    }
}

#[cfg(test)]
mod tests;
