//! `nixl-connect doctor`: what this host offers, and whether the main path works.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use nixl_connect::{nixl_library, Connector, Descriptor, HostBuffer};
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also check that this NATS server answers (e.g. nats://127.0.0.1:4222).
    #[arg(long)]
    nats: Option<String>,
    /// Instead of checking this host: which path a read of (or write into) the peer operation
    /// whose metadata this names would take from here, and why each faster path declines. A
    /// file, `-` for stdin, or `etcd://host:port/key`.
    #[arg(long, value_name = "METADATA")]
    peer: Option<String>,
    /// With `--peer`: where this side's memory would be (`cpu`, `cuda:N`).
    #[arg(long, default_value = "cpu", requires = "peer")]
    device: nixl_connect::Device,
    /// With `--peer`: how long to wait for metadata from etcd, in seconds.
    #[arg(long, default_value_t = 10.0, requires = "peer")]
    timeout: f64,
}

#[derive(Serialize)]
struct Check {
    check: &'static str,
    /// "ok", "warn" (works, but slower or limited), "fail" (broken), "info".
    status: &'static str,
    /// An optional check (NATS, the same-host path, CUDA) failing does not make NIXL unusable.
    optional: bool,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

fn check(check: &'static str, status: &'static str, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check {
        check,
        status,
        optional: false,
        detail: detail.into(),
        fix: fix.map(str::to_string),
    }
}

fn optional(mut c: Check) -> Check {
    c.optional = true;
    c
}

/// The node's RDMA devices, GPU <-> NIC affinity and UCX settings, as checks (all optional: NIXL
/// works over TCP without any RDMA device).
fn node_checks(t: &crate::topology::Topology) -> Vec<Check> {
    let mut out = Vec::new();
    if t.nics.is_empty() {
        out.push(check(
            "RDMA devices",
            "info",
            "none (/sys/class/infiniband is empty or absent): NIXL between hosts goes over TCP \
             (UCX's tcp transport); the same-host path (CMA, CUDA IPC) does not need one",
            None,
        ));
    } else {
        let list: Vec<String> = t
            .nics
            .iter()
            .map(|n| {
                let ports: Vec<String> = n
                    .ports
                    .iter()
                    .map(|p| {
                        let rate = p.rate_gbps.map_or(String::new(), |r| format!(" {r} Gb/s"));
                        format!("port {} {} {}{rate}", p.port, p.state, p.link_layer)
                    })
                    .collect();
                let flag = if n.management {
                    " [management link?]"
                } else if n.virtual_function {
                    " [virtual function]"
                } else if n.bluefield {
                    " [BlueField]"
                } else {
                    ""
                };
                format!(
                    "{} ({}, NUMA {}): {}{flag}",
                    n.name,
                    n.pci.as_deref().unwrap_or("no PCI function"),
                    n.numa.map_or("?".into(), |x| x.to_string()),
                    ports.join(", ")
                )
            })
            .collect();
        let down = t.down_ports();
        out.push(check(
            "RDMA devices",
            if down.is_empty() { "ok" } else { "warn" },
            list.join("; "),
            (!down.is_empty()).then_some(
                "a data port is not ACTIVE: check its cable and subnet manager (ibstat); UCX skips it",
            ),
        ));
        if !down.is_empty() {
            out.last_mut().expect("pushed").detail += &format!("; not active: {}", down.join(", "));
        }
    }
    if !t.gpus.is_empty() && !t.nics.is_empty() {
        let lines: Vec<String> = t
            .gpus
            .iter()
            .map(|g| match t.choices.iter().find(|c| c.gpu == g.pci) {
                Some(c) => format!("GPU {} -> {}:{} ({:?})", g.pci, c.nic, c.port, c.relation),
                None => format!("GPU {} -> no NIC with an active data port", g.pci),
            })
            .collect();
        let fix = t.net_devices(&[]).map(|d| {
            format!(
                "a process using one GPU sets UCX_NET_DEVICES to that GPU's NIC above (all: UCX_NET_DEVICES={d})"
            )
        });
        let mut c = check("GPU <-> NIC", "info", lines.join("; "), None);
        c.fix = fix;
        out.push(c);
    } else {
        out.push(check(
            "GPU <-> NIC",
            "info",
            format!(
                "{} GPU(s), {} RDMA device(s): no pairing to suggest",
                t.gpus.len(),
                t.nics.len()
            ),
            None,
        ));
    }
    let ucx: Vec<String> = t.ucx.iter().map(|(k, v)| format!("{k}={v}")).collect();
    out.push(check(
        "UCX settings",
        "info",
        if ucx.is_empty() {
            "none set (UCX chooses its transports and devices)".to_string()
        } else {
            ucx.join(" ")
        },
        None,
    ));
    out.into_iter().map(optional).collect()
}

/// Whether the kernel lets unrelated processes of one user read each other's memory
/// (cross-memory attach, which the same-host path uses).
fn same_host_path() -> Check {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    let c = match scope {
        None | Some(0) => check(
            "same-host path",
            "ok",
            format!(
                "Rust peers on this host copy directly (process_vm_readv){}",
                scope.map_or(String::new(), |_| "; Yama ptrace_scope 0".into())
            ),
            None,
        ),
        Some(1) => check(
            "same-host path",
            "warn",
            "Yama ptrace_scope is 1: a process may read only its descendants, so unrelated Rust \
             workers on this host fall back to NIXL",
            Some("sysctl kernel.yama.ptrace_scope=0, or start the workers from one parent process"),
        ),
        Some(n) => check(
            "same-host path",
            "warn",
            format!("Yama ptrace_scope is {n}: cross-memory attach is forbidden; Rust peers on this host use NIXL"),
            Some("sysctl kernel.yama.ptrace_scope=0 (needs root; 3 needs a reboot)"),
        ),
    };
    optional(c)
}

/// Whether same-host peers in other network namespaces (pods on this node) can reach this
/// process's connectors: the socket directory both must share (`NIXL_CONNECT_SOCKET_DIR`), and
/// whether a connector serves there now.
fn socket_dir() -> Check {
    let Some(dir) = std::env::var_os("NIXL_CONNECT_SOCKET_DIR").filter(|v| !v.is_empty()) else {
        return check(
            "socket directory",
            "info",
            "not set: Rust peers in another network namespace (another pod) are reached through NIXL",
            Some("set NIXL_CONNECT_SOCKET_DIR to a directory every worker on the node mounts (the README's \"The same-host path\")"),
        );
    };
    let dir = std::path::PathBuf::from(dir);
    let served = Connector::new().ok().and_then(|c| {
        let stem = c
            .name()
            .rsplit_once(".nxc1-")
            .map(|(_, fp)| format!("nxc1-{fp}.sock"))?;
        // This process's uid: /proc/self belongs to it.
        let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").ok()?);
        let path = dir.join(format!("nixl-connect.{uid}")).join(stem);
        Some((path.exists(), path))
    });
    match served {
        Some((true, path)) => match nixl_connect::same_host_across_pid_namespaces() {
            Ok(()) => check(
                "socket directory",
                "ok",
                format!(
                    "{}: a connector serves at {} (peers sharing the directory reach it across network \
                     namespaces; from another PID namespace, as another pod, host memory moves through pipes)",
                    dir.display(),
                    path.display()
                ),
                None,
            ),
            Err(why) => check(
                "socket directory",
                "warn",
                format!(
                    "{}: a connector serves at {} (peers sharing the directory reach it across network \
                     namespaces), but {why}: pods that do not share this one's PID namespace take NIXL",
                    dir.display(),
                    path.display()
                ),
                Some("run a kernel with pidfs (Linux 6.9+), or share the PID namespace (hostPID)"),
            ),
        },
        _ => check(
            "socket directory",
            "warn",
            format!(
                "{}: no connector could serve there{} (see the log line `cannot serve same-host peers through the socket directory`)",
                dir.display(),
                folder_problem(&dir).map_or(String::new(), |p| format!(": {p}"))
            ),
            Some("the directory must be writable, and its nixl-connect.<uid> folder this user's with mode 0700 (in a directory open to all, another user can make it first: give each user a directory of its own, or make the folder before any other user can); keep the path under ~60 bytes"),
        ),
    }
}

/// What is wrong with this user's folder in the socket directory `dir`, if it exists and is not
/// a directory of this user with mode 0700 (another user made it first, or left a link there).
fn folder_problem(dir: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self").ok()?.uid();
    let folder = dir.join(format!("nixl-connect.{uid}"));
    let m = std::fs::symlink_metadata(&folder).ok()?;
    if m.file_type().is_symlink() {
        Some(format!(
            "{} is a link (someone else's?), not this user's folder",
            folder.display()
        ))
    } else if m.uid() != uid {
        Some(format!(
            "{} belongs to uid {}, another user: this user's pods cannot serve there",
            folder.display(),
            m.uid()
        ))
    } else if !m.is_dir() || m.mode() & 0o077 != 0 {
        Some(format!(
            "{} is not a directory with mode 0700 (mode {:o})",
            folder.display(),
            m.mode() & 0o7777
        ))
    } else {
        None
    }
}

/// The NIXL version next to the library: `.nixl/VERSION` from scripts/setup.sh, or the wheel's
/// dist-info folder name in site-packages.
fn nixl_version(lib: &Path) -> String {
    let dir = lib.parent().unwrap_or(Path::new("."));
    if let Ok(v) = std::fs::read_to_string(dir.join("../VERSION")) {
        return v.trim().to_string();
    }
    if let Some(site) = dir.parent() {
        if let Ok(rd) = std::fs::read_dir(site) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("nixl_cu") && n.ends_with(".dist-info") {
                    return n.trim_end_matches(".dist-info").replacen('-', "==", 1);
                }
            }
        }
    }
    "unknown".into()
}

fn plugins(lib: &Path) -> Vec<String> {
    let dir = std::env::var_os("NIXL_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| lib.parent().unwrap_or(Path::new(".")).join("plugins"));
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_prefix("libplugin_")
                        .and_then(|n| n.strip_suffix(".so"))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

async fn self_test() -> Result<Duration> {
    let (a, b) = (Connector::new()?, Connector::new()?);
    let mut src = HostBuffer::new(1 << 20)?;
    crate::pattern::fill(&mut src, 1, 0);
    let r = a.create_readable(Descriptor::from(&src)).await?;
    let mut dst = HostBuffer::new(1 << 20)?;
    let t0 = Instant::now();
    let op = b.begin_read(r.metadata(), Descriptor::from(&mut dst)).await?;
    op.wait_for_completion(Some(Duration::from_secs(10))).await?;
    r.wait_for_completion(Some(Duration::from_secs(10))).await?;
    let took = t0.elapsed();
    drop(op);
    anyhow::ensure!(dst[..] == src[..], "the bytes read differ from the bytes exposed");
    Ok(took)
}

fn cuda() -> Check {
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|rd| rd.count())
        .unwrap_or(0);
    let ldconfig = std::process::Command::new("ldconfig").arg("-p").output().ok();
    let has_lib = ldconfig.is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1"));
    match (has_lib, gpus) {
        (false, 0) => check(
            "CUDA",
            "info",
            "no NVIDIA driver or GPU on this host (host memory only)",
            None,
        ),
        (true, 0) => check(
            "CUDA",
            "info",
            "libcuda.so.1 present but no GPU listed in /proc/driver/nvidia",
            None,
        ),
        (_, n) => check(
            "CUDA",
            "ok",
            format!(
                "{n} NVIDIA GPU(s); driver library {}",
                if has_lib {
                    "found"
                } else {
                    "not in the loader path"
                }
            ),
            None,
        ),
    }
}

/// Which path each pair of memory kinds takes between two workers of this host.
fn device_paths() -> Check {
    use nixl_connect::Device;
    #[cfg(feature = "cuda")]
    let gpus = nixl_connect::cuda::device_count().unwrap_or(0) as u32;
    #[cfg(not(feature = "cuda"))]
    let gpus = 0u32;
    let mut kinds = vec![Device::Host];
    kinds.extend((0..gpus.min(4)).map(Device::Cuda));
    if gpus == 0 {
        kinds.push(Device::Cuda(0));
    }
    let mut lines = Vec::new();
    for &src in &kinds {
        for &dst in &kinds {
            let path = match nixl_connect::same_host_path(src, dst) {
                Ok(()) if src == Device::Host && dst == Device::Host => {
                    match nixl_connect::same_host_across_pid_namespaces() {
                        Ok(()) => "same-host (process_vm_readv; between pods, pipes)".to_string(),
                        Err(_) => "same-host (process_vm_readv; between pods, NIXL: no pidfs)".to_string(),
                    }
                }
                Ok(()) if src == Device::Host => {
                    "same-host (process_vm_readv into pinned staging, then DMA)".to_string()
                }
                // Device sources: legacy handles (cuMemAlloc memory), VMM descriptors for memory
                // without one; between pods, a DeviceBuffer's descriptor (docs/GPU.md).
                Ok(()) => "same-host (CUDA IPC, or a VMM descriptor; between pods, DeviceBuffers as VMM \
                           descriptors, cuMemAlloc memory through NIXL)"
                    .to_string(),
                Err(why) => format!("NIXL ({why})"),
            };
            lines.push(format!("{src}->{dst}: {path}"));
        }
    }
    optional(check("memory pairs", "info", lines.join("; "), None))
}

fn huge_pages() -> Check {
    let v = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let mode = v
        .split_whitespace()
        .find(|w| w.starts_with('['))
        .map(|w| w.trim_matches(['[', ']']).to_string());
    match mode.as_deref() {
        Some("always") | Some("madvise") => check(
            "huge pages",
            "ok",
            format!(
                "transparent huge pages: {} (HostBuffer asks for them from 2 MiB)",
                mode.unwrap()
            ),
            None,
        ),
        Some(m) => check(
            "huge pages",
            "warn",
            format!("transparent huge pages: {m}; large transfers run about 2x slower on 4 KiB pages"),
            Some("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"),
        ),
        None => check(
            "huge pages",
            "info",
            "transparent huge pages not reported by this kernel",
            None,
        ),
    }
}

/// `doctor --peer`: the path an operation with that peer would take from here, and why the
/// faster ones decline, from [`Connector::probe`] (which reaches the peer's same-host socket as
/// an operation would); where it is NIXL, what UCX has to work with on this host.
async fn peer(a: &Args, src: &str) -> Result<()> {
    let timeout = Duration::try_from_secs_f64(a.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a number of seconds, not {}", a.timeout))?;
    let md = crate::transfer::read_metadata(src, timeout).await?;
    let c = Connector::new()?;
    let p = c.probe(&md, a.device).await?;
    let op = if p.is_write() { "write" } else { "read" };
    let bytes: u64 = md.descriptors.iter().map(|d| d.size).sum();
    let remote = md.descriptors[0].device;
    let topo = crate::topology::read_tree(
        &crate::topology::root(),
        std::env::vars().filter(|(k, _)| k.starts_with("UCX_")).collect(),
    );
    let nixl = (p.path() == Some(nixl_connect::TransferPath::Nixl)).then(|| ucx_outlook(&topo));
    if a.json {
        let declined: Vec<serde_json::Value> = p
            .declined()
            .iter()
            .map(|(path, why)| serde_json::json!({"path": path.to_string(), "reason": why}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "peer": p.peer(), "operation": op, "bytes": bytes,
                "remote_device": remote.to_string(), "local_device": a.device.to_string(),
                "path": p.path().map(|x| x.to_string()),
                "mechanism": p.mechanism().map(|m| m.to_string()),
                "declined": declined, "nixl": nixl,
            }))?
        );
        return Ok(());
    }
    let what = if p.is_write() {
        format!(
            "a write from {} memory here into its writable ({} of {remote} memory)",
            a.device,
            crate::human_bytes(bytes as usize)
        )
    } else {
        format!(
            "a read of its readable ({} of {remote} memory) into {} memory here",
            crate::human_bytes(bytes as usize),
            a.device
        )
    };
    println!("peer {}: {what}", p.peer());
    match p.path() {
        Some(path) => println!(
            "  takes the {} path{}",
            words(path),
            p.mechanism().map_or(String::new(), |m| format!(", through {m}"))
        ),
        None => println!("  takes no path: every path this connector may take declines"),
    }
    for (path, why) in p.declined() {
        println!("  not the {} path: {why}", words(*path));
    }
    if let Some(n) = nixl {
        println!("  NIXL here: {n}");
    }
    Ok(())
}

/// A path as the text report names it (`local` is the same-host path's name in JSON and Python).
fn words(p: nixl_connect::TransferPath) -> String {
    match p {
        nixl_connect::TransferPath::SameHost => "same-host".into(),
        nixl_connect::TransferPath::Nixl => "NIXL".into(),
        other => other.to_string(),
    }
}

/// What UCX has to work with here for NIXL between hosts: RDMA devices with an active port, or
/// TCP.
fn ucx_outlook(t: &crate::topology::Topology) -> String {
    let tls = t
        .ucx
        .iter()
        .find(|(k, _)| k == "UCX_TLS")
        .map_or(String::new(), |(_, v)| format!(" (UCX_TLS={v})"));
    if t.nics.is_empty() {
        format!(
            "no RDMA device on this host (/sys/class/infiniband), so UCX moves the bytes over TCP{tls}: \
             expect a fraction of a network's line rate; on another host, an RDMA NIC visible to \
             this process (in a pod: its device plugin's resource) lets UCX use it"
        )
    } else {
        let names: Vec<&str> = t.nics.iter().map(|n| n.name.as_str()).collect();
        format!(
            "RDMA devices {}{tls}: UCX uses them where the peer's host has RDMA too, else TCP",
            names.join(", ")
        )
    }
}

pub(crate) async fn run(a: Args) -> Result<()> {
    if let Some(src) = &a.peer {
        return peer(&a, src).await;
    }
    let mut checks = Vec::new();
    let setup_fix = "run `bash scripts/setup.sh` in the nixl-connect checkout (or `pip install nixl-cu13==1.5.1`, or set NIXL_CONNECT_LIB)";
    let lib = nixl_library::load();
    match &lib {
        Ok(p) => {
            checks.push(check(
                "NIXL library",
                "ok",
                format!("{} ({})", p.display(), nixl_version(p)),
                None,
            ));
            let pl = plugins(p);
            let status = if pl.iter().any(|p| p == "UCX") {
                "ok"
            } else {
                "fail"
            };
            checks.push(check(
                "NIXL plugins",
                status,
                pl.join(", "),
                (status == "fail").then_some(setup_fix),
            ));
        }
        Err(e) => checks.push(check("NIXL library", "fail", e.to_string(), Some(setup_fix))),
    }
    if lib.is_ok() {
        let start = Instant::now();
        match Connector::new() {
            Ok(c) => checks.push(check(
                "UCX backend",
                "ok",
                format!(
                    "agent {} created, started in {:.1} ms",
                    c.name(),
                    start.elapsed().as_secs_f64() * 1e3
                ),
                None,
            )),
            Err(e) => checks.push(check(
                "UCX backend",
                "fail",
                e.to_string(),
                Some("check UCX_* environment variables; run with UCX_LOG_LEVEL=info"),
            )),
        }
        match self_test().await {
            Ok(t) => checks.push(check(
                "self-test",
                "ok",
                format!(
                    "1 MiB readable -> read between two agents, verified, {:.0} us",
                    t.as_secs_f64() * 1e6
                ),
                None,
            )),
            Err(e) => checks.push(check(
                "self-test",
                "fail",
                format!("{e:#}"),
                Some("run with NIXL_LOG_LEVEL=INFO UCX_LOG_LEVEL=info to see why"),
            )),
        }
    }
    checks.push(same_host_path());
    checks.push(optional(socket_dir()));
    checks.push(optional(cuda()));
    checks.push(device_paths());
    checks.push(optional(huge_pages()));
    let topo = crate::topology::read_tree(
        &crate::topology::root(),
        std::env::vars().filter(|(k, _)| k.starts_with("UCX_")).collect(),
    );
    checks.extend(node_checks(&topo));
    if let Some(url) = &a.nats {
        match nixl_connect::channel::nats::NatsChannel::connect(url, Duration::from_secs(3)).await {
            Ok(_) => checks.push(check("NATS", "ok", format!("{url} answers"), None)),
            Err(e) => checks.push(optional(check(
                "NATS",
                "fail",
                e.to_string(),
                Some("start nats-server, or check the URL"),
            ))),
        }
    }
    let failed = checks.iter().any(|c| c.status == "fail" && !c.optional);
    let optional_failed: Vec<&str> = checks
        .iter()
        .filter(|c| c.status == "fail" && c.optional)
        .map(|c| c.check)
        .collect();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"usable": !failed, "optional_failed": optional_failed, "checks": checks, "topology": topo})
            )?
        );
    } else {
        let w = checks.iter().map(|c| c.check.len()).max().unwrap_or(0);
        for c in &checks {
            println!("{:<w$}  {:<4}  {}", c.check, c.status, c.detail);
            if let Some(f) = &c.fix {
                println!("{:<w$}        fix: {f}", "");
            }
        }
        println!(
            "{}{}",
            if failed {
                "NIXL is NOT usable here: see the fixes above."
            } else {
                "NIXL is usable: the main path works."
            },
            if optional_failed.is_empty() {
                String::new()
            } else {
                format!(
                    " Optional checks failed ({}): see their fixes.",
                    optional_failed.join(", ")
                )
            }
        );
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{fake, read_tree};

    #[test]
    fn doctor_prints_each_gpus_nic_and_the_ucx_net_devices_line() {
        let t = fake::eight_by_four("doctor", Some("mlx5_3"));
        let topo = read_tree(&t.root, vec![("UCX_TLS".into(), "rc,cuda_copy".into())]);
        let checks = node_checks(&topo);
        let by = |name: &str| checks.iter().find(|c| c.check == name).expect(name);
        let rdma = by("RDMA devices");
        assert_eq!(rdma.status, "warn");
        assert!(
            rdma.detail.contains("not active: mlx5_3:1 DOWN"),
            "{}",
            rdma.detail
        );
        let pairs = by("GPU <-> NIC");
        assert!(
            pairs.detail.contains("GPU 0000:03:00.0 -> mlx5_0:1 (Switch)"),
            "{}",
            pairs.detail
        );
        assert!(
            pairs.detail.contains("GPU 0000:85:01.0 -> mlx5_2:1 (Switch)"),
            "{}",
            pairs.detail
        );
        let fix = pairs.fix.as_deref().unwrap();
        assert!(
            fix.ends_with("UCX_NET_DEVICES=mlx5_0:1,mlx5_1:1,mlx5_2:1)"),
            "{fix}"
        );
        assert_eq!(by("UCX settings").detail, "UCX_TLS=rc,cuda_copy");
        assert!(checks.iter().all(|c| c.optional));
    }

    #[test]
    fn doctor_says_plainly_when_there_is_no_rdma_device() {
        let t = fake::Tree::new("doctor-none");
        let checks = node_checks(&read_tree(&t.root, Vec::new()));
        let rdma = checks.iter().find(|c| c.check == "RDMA devices").unwrap();
        assert_eq!(rdma.status, "info");
        assert!(
            rdma.detail.starts_with("none") && rdma.detail.contains("over TCP"),
            "{}",
            rdma.detail
        );
        let ucx = checks.iter().find(|c| c.check == "UCX settings").unwrap();
        assert!(ucx.detail.starts_with("none set"));
    }
}
