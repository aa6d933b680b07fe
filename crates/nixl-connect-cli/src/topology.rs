//! The node as NIXL between hosts sees it: RDMA devices and their ports
//! (`/sys/class/infiniband`), GPUs (`/sys/bus/pci/devices`, NVIDIA's display and 3D controllers),
//! where each sits in the PCIe tree, and the NIC each GPU should use (`UCX_NET_DEVICES`).
//!
//! Read from a sysfs root given by the caller (`/` on a host; a fake tree in tests). Affinity is
//! the depth of the PCIe path two devices share, as `nvidia-smi topo` ranks it: under one switch
//! (PIX/PXB) beats one host bridge (PHB), which beats one NUMA node (NODE), which beats crossing
//! NUMA nodes (SYS); among NICs at the same rank, a deeper shared path wins, then an active port,
//! then the name.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// PCI vendor ids.
const NVIDIA: &str = "0x10de";
const MELLANOX: &str = "0x15b3";
/// PCI device ids of BlueField DPUs' NIC functions (BlueField, -2, -3).
const BLUEFIELD: &[&str] = &["0xa2d2", "0xa2d6", "0xa2dc"];
/// Ports slower than this are flagged as likely management or out-of-band links.
const DATA_RATE_GBPS: f64 = 100.0;

/// One port of an RDMA device.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Port {
    pub(crate) port: u32,
    /// As the kernel says it (`ACTIVE`, `DOWN`, `INIT`, ...).
    pub(crate) state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub(crate) link_layer: String,
    /// Gb/s, when the kernel says.
    pub(crate) rate_gbps: Option<f64>,
}

impl Port {
    fn active(&self) -> bool {
        self.state == "ACTIVE"
    }
}

/// One RDMA device (`mlx5_0`, ...).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Nic {
    pub(crate) name: String,
    /// Its PCI function (`0000:0c:00.0`), when it has one.
    pub(crate) pci: Option<String>,
    pub(crate) numa: Option<i32>,
    pub(crate) ports: Vec<Port>,
    /// A BlueField DPU's or SuperNIC's function (flagged; still chosen as a data NIC).
    pub(crate) bluefield: bool,
    /// Every active port is under [`DATA_RATE_GBPS`]: likely a management link, never chosen.
    /// (A port that is down reports the slowest rate: only active ports are judged.)
    pub(crate) management: bool,
    /// An SR-IOV virtual function (`device/physfn`): its physical function is chosen instead.
    pub(crate) virtual_function: bool,
    #[serde(skip)]
    path: Vec<String>,
}

/// One NVIDIA GPU.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Gpu {
    pub(crate) pci: String,
    pub(crate) numa: Option<i32>,
    #[serde(skip)]
    path: Vec<String>,
}

/// How close two devices sit, best first (`nvidia-smi topo`'s names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub(crate) enum Relation {
    /// Under one PCIe switch (PIX / PXB).
    #[serde(rename = "PIX")]
    Switch,
    /// Under one host bridge, no switch shared (PHB).
    #[serde(rename = "PHB")]
    HostBridge,
    /// Other host bridges of one NUMA node (NODE).
    #[serde(rename = "NODE")]
    Node,
    /// Across NUMA nodes (SYS).
    #[serde(rename = "SYS")]
    System,
}

/// The NIC a GPU should use.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Choice {
    pub(crate) gpu: String,
    pub(crate) nic: String,
    pub(crate) port: u32,
    pub(crate) relation: Relation,
}

/// What the tree holds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Topology {
    pub(crate) nics: Vec<Nic>,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) choices: Vec<Choice>,
    /// `UCX_*` variables in force (set in this process's environment).
    pub(crate) ucx: Vec<(String, String)>,
}

/// A sysfs attribute: at most 4 KiB of a regular file (a root given by the user may hold FIFOs
/// or links to devices; real sysfs attributes are small regular files).
fn read(p: &Path) -> Option<String> {
    use std::io::Read;
    if !std::fs::metadata(p).ok()?.is_file() {
        return None;
    }
    let mut s = String::new();
    std::fs::File::open(p)
        .ok()?
        .take(4096)
        .read_to_string(&mut s)
        .ok()?;
    Some(s.trim().to_string())
}

/// A root complex's folder name, `pci0000:00` (`pci` + domain + `:` + bus, in hex).
fn is_root_complex(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("pci") else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 7 && b[4] == b':' && b.iter().enumerate().all(|(i, c)| i == 4 || c.is_ascii_hexdigit())
}

/// Names in natural order (`mlx5_2` before `mlx5_10`).
fn natural(a: &str, b: &str) -> std::cmp::Ordering {
    let split = |s: &str| {
        let d = s.trim_end_matches(|c: char| c.is_ascii_digit());
        (d.to_string(), s[d.len()..].parse::<u64>().ok())
    };
    split(a).cmp(&split(b))
}

/// The PCIe path of a device folder: its canonical path's components from the root complex
/// (`pci0000:00`) down, e.g. `[pci0000:00, 0000:00:01.0, 0000:01:00.0, 0000:02:00.0]`.
fn pci_path(dev: &Path) -> Vec<String> {
    let Ok(real) = dev.canonicalize() else {
        return Vec::new();
    };
    let parts: Vec<String> = real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    match parts.iter().position(|p| is_root_complex(p)) {
        Some(i) => parts[i..].to_vec(),
        None => Vec::new(),
    }
}

fn numa(dev: &Path) -> Option<i32> {
    read(&dev.join("numa_node"))?
        .parse()
        .ok()
        .filter(|n: &i32| *n >= 0)
}

fn rate(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse().ok()
}

fn port(dir: &Path, n: u32) -> Port {
    // `state` reads like "4: ACTIVE".
    let state = read(&dir.join("state")).unwrap_or_default();
    let state = state.split(':').next_back().unwrap_or("").trim().to_string();
    Port {
        port: n,
        state,
        link_layer: read(&dir.join("link_layer")).unwrap_or_default(),
        rate_gbps: read(&dir.join("rate")).as_deref().and_then(rate),
    }
}

/// Reads the tree under `root` (`/` on a host), with `ucx` the `UCX_*` variables in force.
pub(crate) fn read_tree(root: &Path, ucx: Vec<(String, String)>) -> Topology {
    let mut nics = Vec::new();
    let ib = root.join("sys/class/infiniband");
    for e in std::fs::read_dir(&ib).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let dir = e.path();
        let dev = dir.join("device");
        let mut ports: Vec<Port> = std::fs::read_dir(dir.join("ports"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|p| {
                let n = p.file_name().to_string_lossy().parse().ok()?;
                Some(port(&p.path(), n))
            })
            .collect();
        ports.sort_by_key(|p| p.port);
        let path = pci_path(&dev);
        let pci = path.last().filter(|p| !p.starts_with("pci")).cloned();
        let vendor = read(&dev.join("vendor")).unwrap_or_default();
        let device = read(&dev.join("device")).unwrap_or_default();
        let bluefield = vendor == MELLANOX && BLUEFIELD.contains(&device.as_str());
        let active: Vec<&Port> = ports.iter().filter(|p| p.active()).collect();
        let management = !active.is_empty()
            && active
                .iter()
                .all(|p| p.rate_gbps.is_some_and(|r| r < DATA_RATE_GBPS));
        let virtual_function = dev.join("physfn").exists();
        nics.push(Nic {
            name,
            pci,
            numa: numa(&dev),
            ports,
            bluefield,
            management,
            virtual_function,
            path,
        });
    }
    nics.sort_by(|a, b| natural(&a.name, &b.name));
    let mut gpus = Vec::new();
    for e in std::fs::read_dir(root.join("sys/bus/pci/devices"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let dev = e.path();
        let class = read(&dev.join("class")).unwrap_or_default();
        if read(&dev.join("vendor")).as_deref() != Some(NVIDIA)
            || !(class.starts_with("0x0302") || class.starts_with("0x0300"))
        {
            continue;
        }
        gpus.push(Gpu {
            pci: e.file_name().to_string_lossy().into_owned(),
            numa: numa(&dev),
            path: pci_path(&dev),
        });
    }
    gpus.sort_by(|a, b| a.pci.cmp(&b.pci));
    let choices = gpus.iter().filter_map(|g| choose(g, &nics)).collect();
    Topology {
        nics,
        gpus,
        choices,
        ucx,
    }
}

/// How `gpu` and `nic` sit, and the depth of the PCIe path they share.
fn relation(gpu: &Gpu, nic: &Nic) -> (Relation, usize) {
    let shared = gpu.path.iter().zip(&nic.path).take_while(|(a, b)| a == b).count();
    // The root complex, then the root port: sharing more than those is sharing a switch.
    let r = match shared {
        s if s >= 3 => Relation::Switch,
        1 | 2 => Relation::HostBridge,
        _ if gpu.numa.is_some() && gpu.numa == nic.numa => Relation::Node,
        _ => Relation::System,
    };
    (r, shared)
}

/// The NIC (and port) `gpu` should use: an RDMA device with an active data port (not a
/// management link, not a virtual function) closest to it, ties to the deeper shared path, then
/// the name in natural order. `None` when no NIC has an active port.
fn choose(gpu: &Gpu, nics: &[Nic]) -> Option<Choice> {
    nics.iter()
        .filter(|n| !n.management && !n.virtual_function)
        .filter_map(|n| n.ports.iter().find(|p| p.active()).map(|p| (n, p)))
        .map(|(n, p)| {
            let (r, depth) = relation(gpu, n);
            (r, std::cmp::Reverse(depth), n, p)
        })
        .min_by(|a, b| {
            (a.0, a.1)
                .cmp(&(b.0, b.1))
                .then_with(|| natural(&a.2.name, &b.2.name))
        })
        .map(|(relation, _, n, p)| Choice {
            gpu: gpu.pci.clone(),
            nic: n.name.clone(),
            port: p.port,
            relation,
        })
}

impl Topology {
    /// The `UCX_NET_DEVICES` value for a process using `gpus` (PCI addresses; all GPUs when
    /// empty): each chosen NIC's `name:port`, once, in GPU order.
    pub(crate) fn net_devices(&self, gpus: &[String]) -> Option<String> {
        let mut out: Vec<String> = Vec::new();
        for c in &self.choices {
            if gpus.is_empty() || gpus.contains(&c.gpu) {
                let d = format!("{}:{}", c.nic, c.port);
                if !out.contains(&d) {
                    out.push(d);
                }
            }
        }
        (!out.is_empty()).then(|| out.join(","))
    }

    /// Ports not active on NICs that are neither management links nor virtual functions.
    pub(crate) fn down_ports(&self) -> Vec<String> {
        self.nics
            .iter()
            .filter(|n| !n.management && !n.virtual_function)
            .flat_map(|n| {
                n.ports.iter().filter(|p| !p.active()).map(move |p| {
                    format!(
                        "{}:{} {}",
                        n.name,
                        p.port,
                        if p.state.is_empty() { "unknown" } else { &p.state }
                    )
                })
            })
            .collect()
    }
}

/// The sysfs root doctor reads: `/`, or `NIXL_CONNECT_SYSFS_ROOT` (a copy of a node's tree).
pub(crate) fn root() -> PathBuf {
    std::env::var_os("NIXL_CONNECT_SYSFS_ROOT").map_or_else(|| PathBuf::from("/"), PathBuf::from)
}

/// An active 400 Gb/s port, as fake trees write it.
#[cfg(test)]
fn tests_active() -> (&'static str, &'static str) {
    ("4: ACTIVE", "400 Gb/sec (4X NDR)")
}

/// A sysfs root for tests (`tests` builds fake trees under it).
#[cfg(test)]
pub(crate) mod fake {
    use std::path::{Path, PathBuf};

    /// A fake sysfs tree under a temporary folder.
    pub(crate) struct Tree {
        pub(crate) root: PathBuf,
    }

    impl Tree {
        pub(crate) fn new(name: &str) -> Self {
            let root = std::env::temp_dir().join(format!("nxc-sysfs-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("sys/class/infiniband")).unwrap();
            std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
            Self { root }
        }

        fn write(p: &Path, what: &str) {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{what}\n")).unwrap();
        }

        /// A PCI function at `path` (components under `sys/devices`, the last its address),
        /// linked from `sys/bus/pci/devices`.
        pub(crate) fn pci(
            &self,
            path: &[&str],
            vendor: &str,
            device: &str,
            class: &str,
            numa: i32,
        ) -> PathBuf {
            let dev = path.iter().fold(self.root.join("sys/devices"), |p, c| p.join(c));
            Self::write(&dev.join("vendor"), vendor);
            Self::write(&dev.join("device"), device);
            Self::write(&dev.join("class"), class);
            Self::write(&dev.join("numa_node"), &numa.to_string());
            let link = self.root.join("sys/bus/pci/devices").join(path.last().unwrap());
            let up = "../../../devices/".to_string() + &path.join("/");
            std::os::unix::fs::symlink(up, link).unwrap();
            dev
        }

        pub(crate) fn gpu(&self, path: &[&str], numa: i32) {
            self.pci(path, "0x10de", "0x2335", "0x030200", numa);
        }

        /// An RDMA device `name` on the PCI function at `path`, with `ports` (state, rate).
        pub(crate) fn nic(&self, name: &str, path: &[&str], device: &str, numa: i32, ports: &[(&str, &str)]) {
            let dev = self.pci(path, "0x15b3", device, "0x020700", numa);
            let ib = dev.join("infiniband").join(name);
            for (i, (state, rate)) in ports.iter().enumerate() {
                let p = ib.join("ports").join((i + 1).to_string());
                Self::write(&p.join("state"), state);
                Self::write(&p.join("link_layer"), "InfiniBand");
                Self::write(&p.join("rate"), rate);
            }
            std::os::unix::fs::symlink("../..", ib.join("device")).unwrap();
            let up = "../../devices/".to_string() + &path.join("/") + "/infiniband/" + name;
            std::os::unix::fs::symlink(up, self.root.join("sys/class/infiniband").join(name)).unwrap();
        }
    }

    /// 8 GPUs and 4 NICs under 2 switches (one per NUMA node), each switch with two
    /// sub-switches holding two GPUs and one NIC, as on an 8-GPU server.
    pub(crate) fn eight_by_four(name: &str, down: Option<&str>) -> Tree {
        let t = Tree::new(name);
        for (s, (rc, rp, up, numa)) in [
            ("pci0000:00", "0000:00:01.0", "0000:01:00.0", 0),
            ("pci0000:80", "0000:80:01.0", "0000:81:00.0", 1),
        ]
        .into_iter()
        .enumerate()
        {
            let bus = if s == 0 { 0x02 } else { 0x82 };
            for sub in 0..2 {
                let down_port = format!("0000:{bus:02x}:{sub:02x}.0");
                let leaf = bus + 1 + sub as i32 * 2;
                let base = [rc, rp, up, down_port.as_str()];
                for g in 0..2 {
                    let addr = format!("0000:{leaf:02x}:{g:02x}.0");
                    let mut p = base.to_vec();
                    p.push(&addr);
                    t.gpu(&p, numa);
                }
                let nic = format!("mlx5_{}", s * 2 + sub);
                let addr = format!("0000:{:02x}:00.0", leaf + 1);
                let mut p = base.to_vec();
                p.push(&addr);
                let state = if down == Some(nic.as_str()) {
                    ("1: DOWN", "400 Gb/sec (4X NDR)")
                } else {
                    super::tests_active()
                };
                t.nic(&nic, &p, "0x1021", numa, &[state]);
            }
        }
        t
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::Tree;
    use super::*;

    use super::fake::eight_by_four;

    const ACTIVE: (&str, &str) = ("4: ACTIVE", "400 Gb/sec (4X NDR)");

    #[test]
    fn topology_eight_gpus_four_nics_pick_the_nic_under_their_switch() {
        let t = eight_by_four("8x4", None);
        let topo = read_tree(&t.root, Vec::new());
        assert_eq!(topo.gpus.len(), 8);
        assert_eq!(topo.nics.len(), 4);
        let picked: Vec<(&str, Relation)> = topo
            .choices
            .iter()
            .map(|c| (c.nic.as_str(), c.relation))
            .collect();
        assert_eq!(
            picked,
            [
                ("mlx5_0", Relation::Switch),
                ("mlx5_0", Relation::Switch),
                ("mlx5_1", Relation::Switch),
                ("mlx5_1", Relation::Switch),
                ("mlx5_2", Relation::Switch),
                ("mlx5_2", Relation::Switch),
                ("mlx5_3", Relation::Switch),
                ("mlx5_3", Relation::Switch),
            ]
        );
        assert_eq!(
            topo.net_devices(&[]).as_deref(),
            Some("mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1")
        );
        let gpu4 = topo.gpus[4].pci.clone();
        assert_eq!(topo.net_devices(&[gpu4]).as_deref(), Some("mlx5_2:1"));
        assert!(topo.down_ports().is_empty());
        assert_eq!(topo.nics[0].pci.as_deref(), Some("0000:04:00.0"));
        assert_eq!(topo.nics[2].numa, Some(1));
    }

    #[test]
    fn topology_port_down_moves_its_gpus_to_the_next_closest_nic() {
        let t = eight_by_four("down", Some("mlx5_1"));
        let topo = read_tree(&t.root, Vec::new());
        let nics: Vec<&str> = topo.choices.iter().map(|c| c.nic.as_str()).collect();
        // GPUs 2 and 3 lose their sub-switch's NIC: the other NIC under the same switch.
        assert_eq!(
            nics,
            ["mlx5_0", "mlx5_0", "mlx5_0", "mlx5_0", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3"]
        );
        assert_eq!(topo.down_ports(), ["mlx5_1:1 DOWN"]);
    }

    #[test]
    fn topology_host_with_none_has_nothing_to_choose() {
        let t = Tree::new("none");
        let topo = read_tree(&t.root, Vec::new());
        assert!(topo.nics.is_empty() && topo.gpus.is_empty() && topo.choices.is_empty());
        assert_eq!(topo.net_devices(&[]), None);
        // A root with no sysfs at all reads the same.
        let topo = read_tree(Path::new("/nonexistent-root"), Vec::new());
        assert!(topo.nics.is_empty() && topo.gpus.is_empty());
    }

    #[test]
    fn topology_a_down_port_is_down_not_a_management_link() {
        // The kernel reports a down port at the slowest rate ("10 Gb/sec (4X SDR)").
        let t = Tree::new("sdr");
        t.gpu(
            &[
                "pci0000:00",
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:00.0",
                "0000:03:00.0",
            ],
            0,
        );
        t.nic(
            "mlx5_0",
            &[
                "pci0000:00",
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:01.0",
                "0000:04:00.0",
            ],
            "0x1021",
            0,
            &[("1: DOWN", "10 Gb/sec (4X SDR)")],
        );
        let topo = read_tree(&t.root, Vec::new());
        assert!(!topo.nics[0].management);
        assert_eq!(topo.down_ports(), ["mlx5_0:1 DOWN"]);
        assert!(topo.choices.is_empty());
    }

    #[test]
    fn topology_names_sort_naturally_and_roots_are_pci_domains() {
        assert_eq!(natural("mlx5_2", "mlx5_10"), std::cmp::Ordering::Less);
        assert!(is_root_complex("pci0000:00") && is_root_complex("pci10de:8a"));
        assert!(!is_root_complex("pci-dump") && !is_root_complex("pci0000:000"));
    }

    #[test]
    fn topology_bluefield_flagged_and_chosen_management_links_never() {
        let t = Tree::new("bf");
        t.gpu(
            &[
                "pci0000:00",
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:00.0",
                "0000:03:00.0",
            ],
            0,
        );
        t.nic(
            "mlx5_bf",
            &[
                "pci0000:00",
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:01.0",
                "0000:04:00.0",
            ],
            "0xa2dc",
            0,
            &[ACTIVE],
        );
        t.nic(
            "mlx5_mgmt",
            &[
                "pci0000:00",
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:02.0",
                "0000:05:00.0",
            ],
            "0x1017",
            0,
            &[("4: ACTIVE", "25 Gb/sec (1X EDR)")],
        );
        t.nic(
            "mlx5_far",
            &["pci0000:80", "0000:80:01.0", "0000:81:00.0"],
            "0x1021",
            1,
            &[ACTIVE],
        );
        let topo = read_tree(&t.root, Vec::new());
        let flags: Vec<(&str, bool, bool)> = topo
            .nics
            .iter()
            .map(|n| (n.name.as_str(), n.bluefield, n.management))
            .collect();
        assert_eq!(
            flags,
            [
                ("mlx5_bf", true, false),
                ("mlx5_far", false, false),
                ("mlx5_mgmt", false, true)
            ]
        );
        let c = &topo.choices[0];
        // The BlueField under the GPU's switch is chosen; the management link never is.
        assert_eq!((c.nic.as_str(), c.relation), ("mlx5_bf", Relation::Switch));
    }

    #[test]
    fn topology_relations_rank_as_nvidia_smi_topo() {
        let gpu = |path: &[&str], numa| Gpu {
            pci: path.last().unwrap().to_string(),
            numa: Some(numa),
            path: path.iter().map(|s| s.to_string()).collect(),
        };
        let nic = |path: &[&str], numa| Nic {
            name: "n".into(),
            pci: None,
            numa: Some(numa),
            ports: Vec::new(),
            bluefield: false,
            management: false,
            virtual_function: false,
            path: path.iter().map(|s| s.to_string()).collect(),
        };
        let g = gpu(&["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"], 0);
        assert_eq!(
            relation(
                &g,
                &nic(&["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0"], 0)
            )
            .0,
            Relation::Switch
        );
        assert_eq!(
            relation(&g, &nic(&["pci0000:00", "0000:00:02.0", "0000:05:00.0"], 0)).0,
            Relation::HostBridge
        );
        assert_eq!(
            relation(&g, &nic(&["pci0000:40", "0000:40:01.0"], 0)).0,
            Relation::Node
        );
        assert_eq!(
            relation(&g, &nic(&["pci0000:80", "0000:80:01.0"], 1)).0,
            Relation::System
        );
        assert!(Relation::Switch < Relation::HostBridge && Relation::Node < Relation::System);
    }
}
