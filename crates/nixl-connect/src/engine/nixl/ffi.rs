//! The one file that names `nixl_sys`: NIXL's foreign interface.
//!
//! Finds `libnixl_capi.so` and loads it by full path before the `nixl-sys` stub resolves a symbol
//! (the stub aborts when it cannot find the library), and wraps an agent the engine thread owns.
//! No `nixl_sys` type leaves this file.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, NotificationMap, OptArgs, RegDescList, RegistrationHandle,
    ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use crate::device::{Device, DeviceKind};
use crate::error::{Error, ErrorSource, Result};
use crate::reg::Range;
use crate::settings::{NIXL_LIB_ENV, SKIP_VERSION_ENV};
use crate::sync::Recover;

/// The NIXL release this crate is tested against first and suggests installing (what
/// `scripts/setup.sh` installs). The crate builds against every nixl-sys from 1.3.2 to 1.5.x (their
/// C API headers differ only by additions it does not call) and serves the NIXL libraries of
/// [`SUPPORTED_RELEASES`] whichever compiled it.
pub const NIXL_SYS_VERSION: &str = "1.5.1";

/// The NIXL releases (major.minor) this build serves: the ones Dynamo's extras pin. 1.5 only added
/// to 1.4's C API what this crate does not call, and nixl-sys resolves each C function on its
/// first call. `scripts/test-nixl-versions.sh` runs the NIXL tests on each.
pub const SUPPORTED_RELEASES: &[&str] = &["1.4", "1.5"];

const CAPI: &str = "libnixl_capi.so";
/// How long `python3` may take to name its site-packages folders.
const PYTHON_LIMIT: Duration = Duration::from_secs(3);

/// The C API library loaded, once loaded.
static LOADED: Mutex<Option<PathBuf>> = Mutex::new(None);
/// Folders a host program names as holding NIXL (searched after `$NIXL_CONNECT_LIB`).
static PREFERRED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Adds folders (holding `libnixl_capi.so`) to search before the default places.
pub(crate) fn prefer(dirs: Vec<PathBuf>) {
    PREFERRED.lock().recover().extend(dirs);
}

/// The places searched for `libnixl_capi.so`, in order, each group computed only when the ones
/// before it found nothing (`python3` is asked last, bounded by a time limit).
///
/// 1. `$NIXL_CONNECT_LIB` (a file or a folder); when set, nothing else is searched.
/// 2. Folders the host program named ([`prefer`]; the Python module names its environment's
///    `nixl_cu13` / `nixl_cu12` packages).
/// 3. `.nixl/lib` and `nixl/lib` next to the running executable or any of its four parent folders
///    (what `scripts/setup.sh` and the GPU bundle create).
/// 4. The `nixl_cu13` / `nixl_cu12` Python packages' library folders in the site-packages of
///    `$VIRTUAL_ENV`, then of `python3`.
/// 5. `/opt/nvidia/nvda_nixl` (NIXL's own install prefix).
fn search(stop_at_first: bool) -> (Option<PathBuf>, Vec<PathBuf>) {
    let mut tried = Vec::new();
    let mut groups: Vec<Box<dyn FnOnce() -> Vec<PathBuf>>> = Vec::new();
    if let Some(v) = crate::settings::nixl_lib() {
        let p = PathBuf::from(v);
        let p = if p.is_dir() { p.join(CAPI) } else { p };
        let found = p.is_file().then(|| p.clone());
        return (found, vec![p]);
    }
    let preferred = PREFERRED.lock().recover().clone();
    groups.push(Box::new(move || preferred.iter().map(|d| d.join(CAPI)).collect()));
    groups.push(Box::new(|| {
        // No executable's path: an empty one, which has no parent folders.
        let exe = std::env::current_exe().unwrap_or_default();
        let dirs = exe.ancestors().skip(1).take(5);
        dirs.flat_map(|d| [".nixl/lib", "nixl/lib"].map(|l| d.join(l).join(CAPI)))
            .collect()
    }));
    groups.push(Box::new(|| {
        std::env::var_os("VIRTUAL_ENV")
            .map(|v| wheel_dirs(&site_dirs_of_prefix(Path::new(&v))))
            .unwrap_or_default()
    }));
    groups.push(Box::new(|| wheel_dirs(&python_site_dirs())));
    groups.push(Box::new(|| {
        ["lib/x86_64-linux-gnu", "lib64", "lib", "lib/aarch64-linux-gnu"]
            .iter()
            .map(|sub| Path::new("/opt/nvidia/nvda_nixl").join(sub).join(CAPI))
            .collect()
    }));
    let mut found = None;
    for g in groups {
        for p in g() {
            if found.is_none() && p.is_file() {
                found = Some(p.clone());
            }
            tried.push(p);
        }
        if found.is_some() && stop_at_first {
            break;
        }
    }
    (found, tried)
}

/// Every path searched for `libnixl_capi.so`, in order (see [`NIXL_LIB_ENV`]).
pub(crate) fn candidates() -> Vec<PathBuf> {
    search(false).1
}

fn wheel_dirs(sites: &[PathBuf]) -> Vec<PathBuf> {
    let libs = |site: &PathBuf| ["nixl_cu13", "nixl_cu12"].map(|p| site.join(format!(".{p}.mesonpy.libs")));
    sites.iter().flat_map(libs).map(|d| d.join(CAPI)).collect()
}

fn site_dirs_of_prefix(prefix: &Path) -> Vec<PathBuf> {
    ["lib", "lib64"]
        .iter()
        .filter_map(|lib| std::fs::read_dir(prefix.join(lib)).ok())
        .flat_map(|rd| rd.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .collect()
}

/// Asks `python3` for its site-packages folders, giving up after [`PYTHON_LIMIT`].
fn python_site_dirs() -> Vec<PathBuf> {
    let child = std::process::Command::new("python3")
        .args([
            "-c",
            "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn();
    let Ok(child) = child else { return Vec::new() };
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(PYTHON_LIMIT) {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| PathBuf::from(l.trim()))
            .collect(),
        Ok(Err(_)) => Vec::new(),
        Err(_) => {
            // SAFETY: kill(2) on the pid of a child this function spawned and has not reaped (its
            // waiting thread reaps it once it dies).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            tracing::warn!("python3 did not name its site-packages within {PYTHON_LIMIT:?}");
            Vec::new()
        }
    }
}

/// Finds and loads NIXL once per process, returning the C API library's path; later calls return
/// the library already loaded.
pub(crate) fn load() -> Result<PathBuf> {
    let mut guard = LOADED.lock().recover();
    if let Some(l) = guard.as_ref() {
        return Ok(l.clone());
    }
    let (found, searched) = search(true);
    let Some(path) = found else {
        return Err(Error::NixlNotFound { searched });
    };
    if let Some(found) = version_beside(&path) {
        if !supported_release(&found) && !crate::settings::skip_version_check() {
            return Err(Error::NixlLoad {
                reason: format!(
                    "this is NIXL {found}, but nixl-connect serves NIXL {} (built against \
                     {NIXL_SYS_VERSION}; the C API changes between releases): install \
                     `nixl-cu13=={NIXL_SYS_VERSION}` (or nixl-cu12) with pip, or point {NIXL_LIB_ENV} \
                     at a library of one of those releases; {SKIP_VERSION_ENV}=1 skips this check \
                     at your risk",
                    SUPPORTED_RELEASES.join(" and ")
                ),
                path,
            });
        }
    }
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
    *guard = Some(path.clone());
    Ok(path)
}

/// Has every later child of `fork()` make UCX's table of async event handlers and its lock anew
/// (`ucs_async_global_init`) in the fork's child handler, found through NIXL's UCX plugin (so the
/// `libucs` it links) once its backend exists: a fork while UCX's async thread held that lock left
/// the child's first agent waiting forever. UCX offers no fork handler.
fn ucx_fresh_in_children() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let found = loaded_library(|file| file == b"libplugin_UCX.so").and_then(|plugin| {
            // SAFETY: `plugin` names a library already loaded (RTLD_NOLOAD loads nothing; the
            // handle only adds a reference, never closed). dlsym on that handle searches the
            // plugin and the libraries it depends on, its `libucs` among them.
            let f = unsafe {
                let handle = libc::dlopen(plugin.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if handle.is_null() {
                    return None;
                }
                libc::dlsym(handle, c"ucs_async_global_init".as_ptr())
            };
            (!f.is_null()).then_some(f)
        });
        match found {
            // SAFETY: `ucs_async_global_init` is `void (void)` in UCX's sources since its async
            // module (2015), exported by the UCX of each NIXL release served; its library stays
            // loaded for the life of the process (NIXL never unloads a backend's plugin while
            // an agent lives, and this crate never unloads NIXL).
            Some(f) => crate::sys::in_fork_children(unsafe {
                std::mem::transmute::<*mut libc::c_void, extern "C" fn()>(f)
            }),
            None => tracing::warn!(
                "UCX's ucs_async_global_init was not found through NIXL's UCX plugin: a child of \
                 fork() made while UCX is busy in this process may hang making its first agent"
            ),
        }
    });
}

/// What [`loaded_library`] hands the loader's callback: the test, and the path found.
type Search = (fn(&[u8]) -> bool, Option<CString>);

/// The path of the first loaded library whose file name (the part after the last `/`) `is`.
fn loaded_library(is: fn(&[u8]) -> bool) -> Option<CString> {
    extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader hands a valid `dl_phdr_info` whose name is a NUL-terminated string
        // or null; `data` is the `(is, found)` pair below, alive for the whole iteration.
        unsafe {
            let (is, found) = &mut *(data as *mut Search);
            let name = (*info).dlpi_name;
            if name.is_null() {
                return 0;
            }
            let path = std::ffi::CStr::from_ptr(name);
            let file = path.to_bytes().rsplit(|b| *b == b'/').next().unwrap_or_default();
            if is(file) {
                *found = Some(path.to_owned());
                return 1;
            }
            0
        }
    }
    let mut data: Search = (is, None);
    // SAFETY: `each` only reads what the loader hands it and writes `data`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut data as *mut _ as *mut libc::c_void) };
    data.1
}

/// The release of the NIXL library at `capi`, where its installation says it: the wheel's
/// `dist-info` beside `.nixl_cu13.mesonpy.libs/`, or the `VERSION` file `scripts/setup.sh` writes
/// beside `.nixl/lib/` (`nixl-cu13==1.5.1`). `None` where nothing says (a source install).
pub(crate) fn version_beside(capi: &Path) -> Option<String> {
    let dir = capi.parent()?;
    let parent = dir.parent()?;
    if let Ok(text) = std::fs::read_to_string(parent.join("VERSION")) {
        let v = text.trim().rsplit("==").next()?.trim().to_string();
        return (!v.is_empty()).then_some(v);
    }
    let name = dir.file_name()?.to_str()?;
    let pkg = name.strip_prefix('.')?.strip_suffix(".mesonpy.libs")?;
    std::fs::read_dir(parent).ok()?.flatten().find_map(|e| {
        let f = e.file_name();
        let rest = f.to_str()?.strip_prefix(pkg)?.strip_prefix('-')?;
        rest.strip_suffix(".dist-info").map(str::to_owned)
    })
}

/// True when `version`'s major.minor is one of [`SUPPORTED_RELEASES`] (`1.4.1`, `1.5.0`).
pub(crate) fn supported_release(version: &str) -> bool {
    let mm: Vec<&str> = version.trim().split('.').take(2).collect();
    SUPPORTED_RELEASES
        .iter()
        .any(|r| r.split('.').collect::<Vec<_>>() == mm)
}

/// The NIXL memory type of a device.
fn mem_type(device: Device) -> MemType {
    match device.kind() {
        DeviceKind::Host => MemType::Dram,
        DeviceKind::Cuda | DeviceKind::Xpu => MemType::Vram,
    }
}

fn device_id(d: Device) -> u64 {
    u64::from(d.id())
}

/// A NIXL status turned into the library's error.
pub(crate) fn nixl_err(op: &'static str, e: NixlError) -> Error {
    Error::Nixl {
        op,
        status: String::new(),
        source: Some(Arc::new(e)),
    }
}

/// A memory registration; deregistered when dropped (before its agent: the owner sees to it).
pub(crate) struct AgentRegistration {
    handle: ManuallyDrop<RegistrationHandle>,
}

/// An in-flight transfer request; released when dropped. NIXL cannot cancel a posted transfer:
/// releasing one that is still in flight frees the request but lets the transfer run on, so the
/// memory stays in use until the transfer ends or the agent is destroyed.
pub(crate) struct Transfer {
    req: ManuallyDrop<XferRequest>,
}

/// A prepared descriptor list (NIXL's `prepXferDlist`); must be dropped before its agent.
pub(crate) struct Prepared {
    handle: ManuallyDrop<XferDlistHandle>,
    len: usize,
}

// SAFETY: a prepared list is a handle into its agent's state, used (and dropped) only through its
// agent's owner, the engine's NIXL transport. The engine's state sits behind a lock that callers
// driving it take too (`engine::driver`), so it must be `Send`. A caller's turn, with UCX the only
// backend, uses the initiator's prepared lists to post a small transfer (`createXferReq` over them,
// `postXferReq`), polls its transfers (`getXferStatus`, which progresses the initiator's UCX
// worker), releases the requests of those that ended, and drains the exposers' notifications
// (`getNotifs`, which progresses theirs); it never prepares, registers or destroys anything else.
// That an agent may be used from any thread, one at a time, holds there: the agent is created with
// `ThreadSync::None` and no progress thread, for which NIXL's UCX backend makes its context
// `mt_type` SINGLE and so its workers `UCS_THREAD_MODE_SERIALIZED` (any thread, one at a time;
// NIXL's `ucx_utils`), and the lock orders each use after the last (nixl-sys also takes its own
// lock around `getNotifs`). `nixl_sys` already has the agent itself `Send`.
unsafe impl Send for Prepared {}

/// The right to create an agent and to register, describe, load and prepare memory with one
/// (what [`NixlAgent::new`], [`register`](NixlAgent::register), [`prepare`](NixlAgent::prepare)
/// and the like take). The NIXL transport holds it beside its state, which is all a waiter's
/// thread reaches: so by its type a waiter posts, polls and drains, and makes nothing.
pub(crate) struct AgentKey(());

impl AgentKey {
    /// The key of one NIXL transport (made once, with it).
    pub(super) fn new() -> Self {
        AgentKey(())
    }
}

/// One NIXL agent with its backends (UCX, and any others the connector's builder named), NIXL's
/// own threads off. Not thread-safe: one thread at a time uses it (see `Prepared`'s `Send`).
/// Dropping it destroys the UCX worker, which cuts every peer off and ends every transfer.
pub(crate) struct NixlAgent {
    agent: ManuallyDrop<Agent>,
    name: String,
}

// Each drop calls into NIXL, and so runs outside a fork (`sys::outside_fork`), as every method
// of `NixlAgent` does.
macro_rules! drop_outside_fork {
    ($($t:ty => $f:ident),*) => {$(
        impl Drop for $t {
            fn drop(&mut self) {
                // SAFETY: dropped once, here; the field is not used after.
                crate::sys::outside_fork(|| unsafe { ManuallyDrop::drop(&mut self.$f) });
            }
        }
    )*};
}
drop_outside_fork!(AgentRegistration => handle, Transfer => req, Prepared => handle, NixlAgent => agent);

impl NixlAgent {
    /// Creates an agent named `name` with a backend for each of `backends` (NIXL plugin names;
    /// `UCX` takes the extra `params`, the others their plugin's defaults).
    pub(crate) fn new(
        _key: &AgentKey,
        name: &str,
        backends: &[String],
        params: &[(String, String)],
    ) -> Result<Self> {
        load()?;
        crate::sys::outside_fork(|| Self::create(name, backends, params))
    }

    fn create(name: &str, backends: &[String], params: &[(String, String)]) -> Result<Self> {
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            thread_sync: ThreadSync::None,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).map_err(|e| nixl_err("create agent", e))?;
        let plugins: Vec<String> = agent
            .get_available_plugins()
            .map_err(|e| nixl_err("list plugins", e))?
            .iter()
            .filter_map(|p| p.ok().map(str::to_owned))
            .collect();
        for backend in backends {
            if !plugins.iter().any(|p| p == backend) {
                if backend == "UCX" {
                    return Err(Error::NixlBackend {
                        reason: "the UCX plugin (plugins/libplugin_UCX.so next to libnixl.so) was \
                                 not found; reinstall NIXL with `bash scripts/setup.sh` or set \
                                 NIXL_PLUGIN_DIR"
                            .into(),
                        source: None,
                    });
                }
                return Err(Error::InvalidArgument(format!(
                    "NIXL has no backend plugin {backend:?}; the plugins found are: {}",
                    plugins.join(", ")
                )));
            }
            let (_mems, defaults) = agent
                .get_plugin_params(backend)
                .map_err(|e| nixl_err("plugin params", e))?;
            let mut p = defaults.clone().map_err(|e| nixl_err("plugin params", e))?;
            if backend == "UCX" {
                let known: Vec<String> = defaults
                    .iter()
                    .map_err(|e| nixl_err("UCX plugin params", e))?
                    .filter_map(|kv| kv.ok().map(|(k, _)| k.to_owned()))
                    .collect();
                for (k, v) in params {
                    // `engine_config` (UCX settings, `KEY=value,...`) is read by the plugin but
                    // not advertised among its defaults.
                    if !known.iter().any(|n| n == k) && k != "engine_config" {
                        return Err(Error::InvalidArgument(format!(
                            "unknown UCX backend parameter {k:?}; NIXL's UCX plugin takes: {}",
                            known.join(", ")
                        )));
                    }
                    p.set(k, v).map_err(|e| nixl_err("UCX backend param", e))?;
                }
            }
            agent
                .create_backend(backend, &p)
                .map_err(|e| Error::NixlBackend {
                    reason: format!(
                        "creating the {backend} backend failed; check its environment (UCX_* \
                         variables for UCX) or leave it out of the connector's backends"
                    ),
                    source: Some(Arc::new(e)),
                })?;
        }
        if backends.iter().any(|b| b == "UCX") {
            ucx_fresh_in_children();
        }
        Ok(Self {
            agent: ManuallyDrop::new(agent),
            name: name.to_string(),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Registers one range.
    pub(crate) fn register(&self, _key: &AgentKey, r: Range) -> Result<AgentRegistration> {
        crate::sys::outside_fork(|| {
            let handle = self
                .agent
                .register_memory(&RawRegion(r), None)
                .map_err(|e| nixl_err("register memory", e))?;
            Ok(AgentRegistration {
                handle: ManuallyDrop::new(handle),
            })
        })
    }

    /// This agent's metadata restricted to `regs` (exactly registered ranges): the connection
    /// information alone when `regs` is empty, the sections of those registrations otherwise.
    pub(crate) fn partial_metadata(&self, _key: &AgentKey, regs: &[Range]) -> Result<Vec<u8>> {
        crate::sys::outside_fork(|| {
            let mut l = RegDescList::new(regs.first().map_or(MemType::Dram, |r| mem_type(r.device)))
                .map_err(|e| nixl_err("descriptor list", e))?;
            for r in regs {
                l.add_desc(r.addr, r.len, device_id(r.device));
            }
            self.agent
                .get_local_partial_md(&l, None)
                .map_err(|e| nixl_err("get local metadata", e))
        })
    }

    /// Loads a peer's agent metadata (merging into what is loaded for it); returns its name.
    pub(crate) fn load_remote(&self, _key: &AgentKey, md: &[u8]) -> std::result::Result<String, ErrorSource> {
        crate::sys::outside_fork(|| {
            self.agent
                .load_remote_md(md)
                .map_err(|e| Arc::new(e) as ErrorSource)
        })
    }

    /// Forgets a peer's agent metadata and drops this agent's connection to it.
    pub(crate) fn invalidate_remote(&self, name: &str) {
        crate::sys::outside_fork(|| {
            if let Err(e) = self.agent.invalidate_remote_md(name) {
                tracing::debug!(remote = name, error = %e, "invalidate remote metadata failed");
            }
        })
    }

    /// Prepares a descriptor list once, for any number of transfers: `agent` is `None` for this
    /// agent's own (registered) memory, or the peer whose metadata describes `ranges`.
    pub(crate) fn prepare(&self, _key: &AgentKey, agent: Option<&str>, ranges: &[Range]) -> Result<Prepared> {
        crate::sys::outside_fork(|| {
            let mut l =
                XferDescList::new(mem_type(ranges[0].device)).map_err(|e| nixl_err("descriptor list", e))?;
            for r in ranges {
                l.add_desc(r.addr, r.len, device_id(r.device));
            }
            let handle = self
                .agent
                .prepare_xfer_dlist(agent.unwrap_or(""), &l, None)
                .map_err(|e| Error::Nixl {
                    op: "create transfer",
                    status: match agent {
                        Some(a) => format!(
                            "the remote descriptors are not registered memory of agent {a}, or the \
                             metadata is stale"
                        ),
                        None => "preparing local descriptors".into(),
                    },
                    source: Some(Arc::new(e)),
                })?;
            Ok(Prepared {
                handle: ManuallyDrop::new(handle),
                len: ranges.len(),
            })
        })
    }

    /// Posts a transfer between prepared lists; `Ok(None)` when it completed during the post.
    pub(crate) fn post_prepared(
        &self,
        write: bool,
        local: &Prepared,
        remote: &Prepared,
        notification: &[u8],
    ) -> std::result::Result<Option<Transfer>, PostError> {
        crate::sys::outside_fork(|| {
            let idx: Vec<i32> = (0..local.len as i32).collect();
            let mut args = OptArgs::new().map_err(|e| PostError::Local(nixl_err("transfer options", e)))?;
            args.set_notification_message(notification)
                .map_err(|e| PostError::Local(nixl_err("notification message", e)))?;
            args.set_has_notification(true)
                .map_err(|e| PostError::Local(nixl_err("notification flag", e)))?;
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
                .map_err(|e| PostError::Local(nixl_err("create transfer", e)))?;
            match self.agent.post_xfer_req(&req, Some(&args)) {
                Ok(true) => Ok(Some(Transfer {
                    req: ManuallyDrop::new(req),
                })),
                Ok(false) => Ok(None),
                Err(e) => Err(PostError::Transfer(Arc::new(e))),
            }
        })
    }

    /// Polls one transfer (this also progresses the UCX worker).
    pub(crate) fn poll(&self, t: &Transfer) -> std::result::Result<bool, ErrorSource> {
        crate::sys::outside_fork(|| match self.agent.get_xfer_status(&t.req) {
            Ok(XferStatus::InProgress) => Ok(false),
            Ok(XferStatus::Success) => Ok(true),
            Err(e) => Err(Arc::new(e) as ErrorSource),
        })
    }

    /// Drains the notifications that have arrived (this also progresses the UCX worker):
    /// `(from agent, message bytes)`.
    pub(crate) fn notifications(&self, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        crate::sys::outside_fork(|| {
            let mut map = NotificationMap::new().map_err(|e| nixl_err("notification map", e))?;
            self.agent
                .get_notifications(&mut map, None)
                .map_err(|e| nixl_err("get notifications", e))?;
            let agents: Vec<String> = map.agents().filter_map(|a| a.ok().map(str::to_owned)).collect();
            for a in agents {
                for i in 0..map.get_notifications_size(&a).unwrap_or(0) {
                    if let Ok(b) = map.get_notification_bytes(&a, i) {
                        out.push((a.clone(), b));
                    }
                }
            }
            Ok(())
        })
    }
}

/// Why a post failed: before anything reached the peer (`Local`), or in the transport.
pub(crate) enum PostError {
    Local(Error),
    Transfer(ErrorSource),
}

/// A raw range handed to nixl-sys for registration.
#[derive(Debug)]
struct RawRegion(Range);

impl nixl_sys::MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.addr as *const u8
    }
    fn size(&self) -> usize {
        self.0.len
    }
}

impl nixl_sys::NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        mem_type(self.0.device)
    }
    fn device_id(&self) -> u64 {
        device_id(self.0.device)
    }
}

#[cfg(test)]
mod tests;
