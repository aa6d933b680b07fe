//! The one module that talks to NIXL.
//!
//! Everything NIXL-specific lives here: finding `libnixl_capi.so` at run time, loading it by full
//! path before the `nixl-sys` stub ever resolves a symbol (the stub aborts the process when it
//! cannot find the library, so it must never get that far), and a thin wrapper over the agent that
//! the engine thread owns. No `nixl_sys` type leaves this module.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, NotificationMap, OptArgs, RegistrationHandle, ThreadSync,
    XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};

/// Environment variable naming the NIXL library (a `libnixl_capi.so` file or a folder holding it).
pub const NIXL_LIB_ENV: &str = "NIXL_CONNECT_LIB";

const CAPI: &str = "libnixl_capi.so";

/// Where the NIXL library was found and loaded from.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    pub(crate) capi: PathBuf,
}

static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

/// The folders searched for `libnixl_capi.so`, in order.
///
/// 1. `$NIXL_CONNECT_LIB` (a file or a folder); when set, nothing else is searched.
/// 2. `.nixl/lib` and `nixl/lib` next to the running executable or any of its four parent folders
///    (what `scripts/setup.sh` and the GPU bundle create).
/// 3. The `nixl_cu13` / `nixl_cu12` Python packages' library folders in the site-packages of
///    `$VIRTUAL_ENV` and of `python3`.
/// 4. `/opt/nvidia/nvda_nixl` (NIXL's own install prefix).
pub(crate) fn candidates() -> Vec<PathBuf> {
    if let Some(v) = std::env::var_os(NIXL_LIB_ENV) {
        let p = PathBuf::from(v);
        return vec![if p.is_dir() { p.join(CAPI) } else { p }];
    }
    let mut out = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(5) {
            out.push(dir.join(".nixl/lib").join(CAPI));
            out.push(dir.join("nixl/lib").join(CAPI));
        }
    }
    for site in python_site_dirs() {
        for pkg in ["nixl_cu13", "nixl_cu12"] {
            out.push(site.join(format!(".{pkg}.mesonpy.libs")).join(CAPI));
        }
    }
    for sub in ["lib/x86_64-linux-gnu", "lib64", "lib", "lib/aarch64-linux-gnu"] {
        out.push(Path::new("/opt/nvidia/nvda_nixl").join(sub).join(CAPI));
    }
    out
}

fn python_site_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut from_prefix = |prefix: &Path| {
        for lib in ["lib", "lib64"] {
            if let Ok(rd) = std::fs::read_dir(prefix.join(lib)) {
                for e in rd.flatten() {
                    let name = e.file_name();
                    if name.to_string_lossy().starts_with("python3") {
                        dirs.push(e.path().join("site-packages"));
                    }
                }
            }
        }
    };
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        from_prefix(Path::new(&venv));
    }
    // Ask the interpreter itself, bounded: it is the last resort before /opt.
    if let Ok(out) = std::process::Command::new("python3")
        .args([
            "-c",
            "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))",
        ])
        .stderr(std::process::Stdio::null())
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            dirs.push(PathBuf::from(line.trim()));
        }
    }
    dirs
}

/// Finds and loads NIXL once per process; later calls return the library already loaded.
pub(crate) fn load() -> Result<Loaded> {
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = guard.as_ref() {
        return Ok(l.clone());
    }
    let searched = candidates();
    let Some(path) = searched.iter().find(|p| p.is_file()).cloned() else {
        return Err(Error::NixlNotFound { searched });
    };
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::NixlLoad {
        path: path.clone(),
        reason: "path contains NUL".into(),
    })?;
    // SAFETY: `c` is a valid NUL-terminated path. dlopen runs the library's initialisers, which is
    // what loading NIXL means; the handle is deliberately never closed (the library stays loaded for
    // the life of the process, as the nixl-sys stub expects). RTLD_GLOBAL lets the stub's later
    // dlopen("libnixl_capi.so") find this copy by its soname instead of searching the default path.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let reason = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(Error::NixlLoad { path, reason });
    }
    let l = Loaded { capi: path };
    *guard = Some(l.clone());
    Ok(l)
}

/// The NIXL memory type of a device.
fn mem_type(device: Device) -> MemType {
    match device.kind() {
        DeviceKind::Host => MemType::Dram,
        DeviceKind::Cuda | DeviceKind::Xpu => MemType::Vram,
    }
}

/// A NIXL status turned into the library's engine error.
pub(crate) fn nixl_err(op: &'static str, e: NixlError) -> Error {
    Error::Nixl {
        op,
        status: e.to_string(),
    }
}

/// One memory range as NIXL sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Range {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) device: Device,
}

/// A memory registration; deregistered when dropped.
pub(crate) struct Registration {
    _handle: RegistrationHandle,
}

/// Options of the UCX backend this library creates.
#[derive(Debug, Clone, Default)]
pub(crate) struct BackendOptions {
    /// Extra UCX backend parameters (`ucx_error_handling_mode`, `num_workers`, ...).
    pub(crate) params: Vec<(String, String)>,
}

/// The agent, owned by the engine thread.
pub(crate) struct NixlAgent {
    agent: Agent,
}

/// An in-flight transfer request; released (and its handle freed) when dropped.
pub(crate) struct Transfer {
    req: XferRequest,
}

/// A prepared descriptor list (NIXL's `prepXferDlist`), released when dropped; must be dropped
/// before the agent.
pub(crate) struct Prepared {
    handle: XferDlistHandle,
    len: usize,
}

/// What a transfer poll found.
pub(crate) enum Poll {
    Pending,
    Done,
    Failed(Error),
}

impl NixlAgent {
    /// Creates an agent named `name` with the UCX backend and NIXL's own threads off.
    pub(crate) fn new(name: &str, opts: &BackendOptions) -> Result<Self> {
        load()?;
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            thread_sync: ThreadSync::None,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).map_err(|e| nixl_err("create agent", e))?;
        let plugins = agent
            .get_available_plugins()
            .map_err(|e| nixl_err("list plugins", e))?;
        let has_ucx = plugins.iter().any(|p| p.map(|s| s == "UCX").unwrap_or(false));
        if !has_ucx {
            return Err(Error::NixlBackend {
                reason: "the UCX plugin (plugins/libplugin_UCX.so next to libnixl.so) was not found; \
                         reinstall NIXL with `bash scripts/setup.sh` or set NIXL_PLUGIN_DIR"
                    .into(),
            });
        }
        let (_mems, defaults) = agent
            .get_plugin_params("UCX")
            .map_err(|e| nixl_err("UCX plugin params", e))?;
        let mut params = defaults.clone().map_err(|e| nixl_err("UCX plugin params", e))?;
        for (k, v) in &opts.params {
            params.set(k, v).map_err(|e| nixl_err("UCX backend param", e))?;
        }
        agent
            .create_backend("UCX", &params)
            .map_err(|e| Error::NixlBackend {
                reason: format!("creating the UCX backend failed ({e}); check UCX_* environment variables"),
            })?;
        Ok(Self { agent })
    }

    /// This agent's metadata (connection info and registered memory), for a peer to load.
    pub(crate) fn local_metadata(&self) -> Result<Vec<u8>> {
        self.agent
            .get_local_md()
            .map_err(|e| nixl_err("get local metadata", e))
    }

    /// Registers one range.
    pub(crate) fn register(&self, r: Range) -> Result<Registration> {
        let desc = RawRegion {
            addr: r.addr,
            len: r.len,
            mem: mem_type(r.device),
            dev: device_id(r.device),
        };
        let handle = self
            .agent
            .register_memory(&desc, None)
            .map_err(|e| nixl_err("register memory", e))?;
        Ok(Registration { _handle: handle })
    }

    /// Loads a peer's agent metadata; returns the peer's agent name.
    pub(crate) fn load_remote(&self, md: &[u8]) -> Result<String> {
        self.agent.load_remote_md(md).map_err(|e| Error::Metadata {
            field: "nixl_metadata",
            reason: format!(
                "NIXL could not load the peer's agent metadata ({e}): it is not NIXL agent metadata, \
                 or the peer that published it has exited"
            ),
        })
    }

    /// Forgets a peer's agent metadata.
    pub(crate) fn invalidate_remote(&self, name: &str) {
        if let Err(e) = self.agent.invalidate_remote_md(name) {
            tracing::debug!(remote = name, error = %e, "invalidate remote metadata failed");
        }
    }

    /// Prepares a descriptor list once, for any number of transfers: `agent` is `None` for this
    /// agent's own (registered) memory, or the peer whose metadata describes `ranges`.
    pub(crate) fn prepare(&self, agent: Option<&str>, ranges: &[Range]) -> Result<Prepared> {
        let mut l =
            XferDescList::new(mem_type(ranges[0].device)).map_err(|e| nixl_err("descriptor list", e))?;
        for r in ranges {
            l.add_desc(r.addr, r.len, device_id(r.device));
        }
        let handle = self.agent.prepare_xfer_dlist(agent.unwrap_or(""), &l, None).map_err(|e| Error::Nixl {
            op: "create transfer",
            status: match agent {
                Some(a) => format!(
                    "{e}: the remote descriptors are not registered memory of agent {a}, or the metadata is stale"
                ),
                None => format!("{e}: preparing local descriptors"),
            },
        })?;
        Ok(Prepared {
            handle,
            len: ranges.len(),
        })
    }

    /// Posts a transfer between prepared lists; `Ok(None)` when it completed during the post.
    pub(crate) fn post_prepared(
        &self,
        write: bool,
        local: &Prepared,
        remote: &Prepared,
        remote_agent: &str,
        notification: &[u8],
    ) -> Result<Option<Transfer>> {
        let idx: Vec<i32> = (0..local.len as i32).collect();
        let mut args = OptArgs::new().map_err(|e| nixl_err("transfer options", e))?;
        args.set_notification_message(notification)
            .map_err(|e| nixl_err("notification message", e))?;
        args.set_has_notification(true)
            .map_err(|e| nixl_err("notification flag", e))?;
        let op = if write { XferOp::Write } else { XferOp::Read };
        let req = self
            .agent
            .make_xfer_req(
                op,
                &local.handle,
                &idx,
                &remote.handle,
                &idx[..remote.len],
                Some(&args),
            )
            .map_err(|e| Error::Nixl {
                op: "create transfer",
                status: e.to_string(),
            })?;
        let in_progress = self
            .agent
            .post_xfer_req(&req, Some(&args))
            .map_err(|e| transfer_failed(remote_agent, e))?;
        Ok(if in_progress { Some(Transfer { req }) } else { None })
    }

    /// Polls one transfer (this also progresses the UCX worker).
    pub(crate) fn poll(&self, t: &Transfer, remote_agent: &str) -> Poll {
        match self.agent.get_xfer_status(&t.req) {
            Ok(XferStatus::InProgress) => Poll::Pending,
            Ok(XferStatus::Success) => Poll::Done,
            Err(e) => Poll::Failed(transfer_failed(remote_agent, e)),
        }
    }

    /// Drains the notifications that have arrived: `(from agent, message bytes)`.
    pub(crate) fn notifications(&self, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        let mut map = NotificationMap::new().map_err(|e| nixl_err("notification map", e))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(|e| nixl_err("get notifications", e))?;
        let agents: Vec<String> = map.agents().filter_map(|a| a.ok().map(str::to_owned)).collect();
        for a in agents {
            let n = map.get_notifications_size(&a).unwrap_or(0);
            for i in 0..n {
                if let Ok(b) = map.get_notification_bytes(&a, i) {
                    out.push((a.clone(), b));
                }
            }
        }
        Ok(())
    }
}

fn transfer_failed(remote_agent: &str, e: NixlError) -> Error {
    match e {
        NixlError::BackendError => Error::RemoteGone {
            agent: remote_agent.to_string(),
            reason: "the transfer failed in the UCX backend (peer exited or unreachable)".into(),
        },
        other => nixl_err("transfer", other),
    }
}

fn device_id(d: Device) -> u64 {
    match d {
        Device::Host => 0,
        Device::Cuda(n) | Device::Xpu(n) => u64::from(n),
    }
}

/// A raw range handed to nixl-sys for registration.
#[derive(Debug)]
struct RawRegion {
    addr: usize,
    len: usize,
    mem: MemType,
    dev: u64,
}

impl nixl_sys::MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl nixl_sys::NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.dev
    }
}

/// The NIXL version the library was built against (the pinned nixl-sys release).
pub const NIXL_SYS_VERSION: &str = "1.5.1";
