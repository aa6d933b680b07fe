//! The device path's refusals: which pairs of memory the same-host device path can move.

use crate::device::Device;
use crate::error::PathRefusal;
use crate::reg::Range;
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;

/// The one device all `ranges` are on, or `None` for none or several.
pub(super) fn uniform(ranges: &[Range]) -> Option<Device> {
    let d = ranges.first()?.device;
    ranges.iter().all(|r| r.device == d).then_some(d)
}

/// Why the device path cannot move a transfer from memory on `src` into memory on `dst`, if it
/// cannot (the host path takes host-to-host; host into device memory is pulled through pinned
/// staging by the device memory's owner, which needs CUDA).
pub(crate) fn device_path_refusal(src: Device, dst: Device) -> Option<PathRefusal> {
    match (src, dst) {
        (Device::Cuda(_), Device::Cuda(_) | Device::Host) | (Device::Host, Device::Cuda(_))
            if cfg!(feature = "cuda") =>
        {
            // The first ask may initialise CUDA, so it is the engine thread's: a waiter's thread
            // drives this transport only once the answer is known (`ipc::settled_for_callers`).
            #[cfg(feature = "cuda")]
            if !ipc::available() {
                return Some(PathRefusal::NoCudaDevice);
            }
            None
        }
        (Device::Cuda(_), Device::Cuda(_) | Device::Host) => Some(PathRefusal::NoCudaSupport),
        (Device::Host, Device::Cuda(_)) => Some(PathRefusal::HostIntoDevice),
        _ => Some(PathRefusal::UnsupportedMemory),
    }
}
