//! The one exception type of the core, `CoreError(kind, message, class)`, and the choice of the
//! `nixl_connect` exception class the Python layer raises for each kind of the Rust core's errors.

use nixl_connect::{Error, ErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _core,
    CoreError,
    PyException,
    "An error of the Rust core: args are (kind, message, class), kind the Rust error's kind, \
     class the name of the `nixl_connect` exception class to raise for it."
);

/// The `nixl_connect` exception class (in `_errors.py`) raised for each kind of core error: the
/// choice is made here, beside the kinds; `test_core_chooses_the_class_of_every_kind`
/// (tests/python/test_extras.py) fails when a kind has none or names another kind's class.
pub(crate) fn class_of(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::WrongPairing => "WrongPairingError",
        ErrorKind::DeviceMismatch => "DeviceMismatchError",
        ErrorKind::DescriptorMismatch => "DescriptorMismatchError",
        ErrorKind::Metadata => "MetadataError",
        ErrorKind::Refused => "RefusedError",
        ErrorKind::NixlNotFound => "NixlNotFoundError",
        ErrorKind::NixlLoad => "NixlLoadError",
        ErrorKind::CudaUnavailable => "CudaUnavailableError",
        ErrorKind::NixlBackend => "NixlBackendError",
        ErrorKind::Os => "OsError",
        ErrorKind::Nixl => "NixlError",
        ErrorKind::RemoteGone => "RemoteGoneError",
        ErrorKind::Transfer => "TransferError",
        ErrorKind::Interrupted => "TransferInterruptedError",
        ErrorKind::PathUnavailable => "PathUnavailableError",
        ErrorKind::EngineStopped => "EngineStoppedError",
        ErrorKind::Cancelled => "CancelledError",
        ErrorKind::TimedOut => "TimeoutError",
        ErrorKind::Channel => "ChannelError",
        ErrorKind::NotPublished => "NotPublishedError",
        _ => UNKNOWN_CLASS,
    }
}

/// The class for a kind this module does not know yet (a newer core).
const UNKNOWN_CLASS: &str = "NixlConnectError";

/// The error of an object used in a process forked after it was made: a kind of this module's
/// own, since the core has no such error.
pub(crate) const FORKED: (&str, &str) = ("Forked", "ForkedError");

pub(crate) fn err(e: Error) -> PyErr {
    let kind = e.kind();
    CoreError::new_err((kind.as_str(), e.report().to_string(), class_of(kind)))
}

pub(crate) fn invalid(msg: String) -> PyErr {
    let kind = ErrorKind::InvalidArgument;
    CoreError::new_err((kind.as_str(), msg, class_of(kind)))
}

/// Every kind of core error, with the class raised for it: `(kind, class)` pairs, the forked
/// object's error included (for the Python layer's own checks).
#[pyfunction]
pub(crate) fn error_classes() -> Vec<(&'static str, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (k.as_str(), class_of(*k)))
        .chain([FORKED])
        .collect()
}
