//! Every `NIXL_CONNECT_*` environment variable the library reads, read here and nowhere else
//! (the README's "Environment" table lists them, with the CLI's and the Python module's own).
//!
//! A connector's settings are read when it is built ([`ConnectorBuilder::build`]) and handed
//! down with its options; the process's settings (where NIXL is, what the device path may
//! share, how many lanes staging uses) are read once, on first use, and kept for the process's
//! life: the library they govern is loaded, or the pool they size is made, once.
//!
//! [`ConnectorBuilder::build`]: crate::ConnectorBuilder::build

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Where to load NIXL from (a file or a folder holding `libnixl_capi.so`): when set, nothing
/// else is searched.
pub const NIXL_LIB_ENV: &str = "NIXL_CONNECT_LIB";

/// Set (to anything) to load a NIXL release other than those this build serves, at your risk.
pub const SKIP_VERSION_ENV: &str = "NIXL_CONNECT_SKIP_VERSION_CHECK";

/// The environment variable that sets every connector's wait spin, in microseconds, where
/// [`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin) is not called (`0` turns
/// it off).
pub const WAIT_SPIN_ENV: &str = "NIXL_CONNECT_WAIT_SPIN_US";

/// The address [`HttpChannel::global`](crate::channel::http::HttpChannel::global) binds (default
/// `127.0.0.1:0`).
#[cfg(feature = "http")]
pub const LISTEN_ENV: &str = "NIXL_CONNECT_HTTP_LISTEN";

/// A directory shared with same-host peers in other network namespaces (pods), where
/// [`ConnectorBuilder::socket_dir`](crate::ConnectorBuilder::socket_dir) is not called.
pub(crate) const SOCKET_DIR_ENV: &str = "NIXL_CONNECT_SOCKET_DIR";

/// How many lanes one staged device copy uses (1 to 16; default: half the cores, at most 8).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const STAGING_LANES_ENV: &str = "NIXL_CONNECT_STAGING_LANES";

/// `1` shares VMM memory this crate did not allocate (PyTorch's expandable segments) as
/// descriptors with peers in other PID namespaces.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const SHARE_VMM_ENV: &str = "NIXL_CONNECT_SHARE_VMM";

/// [`NIXL_LIB_ENV`]'s value, read at each search (a test may point it elsewhere before NIXL is
/// loaded).
pub(crate) fn nixl_lib() -> Option<OsString> {
    std::env::var_os(NIXL_LIB_ENV)
}

/// Whether [`SKIP_VERSION_ENV`] is set.
pub(crate) fn skip_version_check() -> bool {
    std::env::var_os(SKIP_VERSION_ENV).is_some()
}

/// [`WAIT_SPIN_ENV`]'s value as text: none when unset; refused when it is not UTF-8.
///
/// # Errors
/// [`Error::InvalidArgument`] for a value that is not UTF-8.
pub(crate) fn wait_spin() -> Result<Option<String>> {
    match std::env::var(WAIT_SPIN_ENV) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidArgument(format!(
            "{WAIT_SPIN_ENV}={v:?} is not UTF-8 text (unset it, or set a number)"
        ))),
    }
}

/// [`LISTEN_ENV`]'s value, if set and text.
#[cfg(feature = "http")]
pub(crate) fn http_listen() -> Option<String> {
    std::env::var(LISTEN_ENV).ok()
}

/// [`SOCKET_DIR_ENV`]'s value, if set and not empty.
pub(crate) fn socket_dir() -> Option<PathBuf> {
    std::env::var_os(SOCKET_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The process's settings: read once, on first use.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Process {
    /// [`STAGING_LANES_ENV`]'s value, if set and text.
    staging_lanes: Option<String>,
    /// [`SHARE_VMM_ENV`] is `1`.
    share_vmm: bool,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Process {
    /// [`STAGING_LANES_ENV`]'s value, if set and text.
    pub(crate) fn staging_lanes(&self) -> Option<&str> {
        self.staging_lanes.as_deref()
    }

    /// [`SHARE_VMM_ENV`] is `1`.
    pub(crate) fn share_vmm(&self) -> bool {
        self.share_vmm
    }
}

/// The process's settings (see [`Process`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn process() -> &'static Process {
    static READ: OnceLock<Process> = OnceLock::new();
    READ.get_or_init(|| Process {
        staging_lanes: std::env::var(STAGING_LANES_ENV).ok(),
        share_vmm: std::env::var(SHARE_VMM_ENV).is_ok_and(|v| v == "1"),
    })
}
