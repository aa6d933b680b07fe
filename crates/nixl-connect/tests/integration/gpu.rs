//! GPU memory (feature `cuda`): VRAM to VRAM, VRAM to host and host to VRAM, read and write, one
//! and many descriptors, in one process and across two, byte-exact; across two processes the
//! same-host path through CUDA IPC (device memory as the source) or NIXL (host memory into device
//! memory), reallocated memory, and either process killed mid-copy.
//!
//! With no CUDA driver or no GPU each test prints `skipped: <reason>` and returns; on the GPU host
//! `NIXL_CONNECT_REQUIRE_GPU=1` (set by `scripts/gpu-run.sh`) makes a skip a failure.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use nixl_connect::cuda::{self, CudaContext, CudaStream};
use nixl_connect::{Connector, Descriptor, Device, Error, RdmaMetadata, TransferPath};

use super::support::POD;

const T: Option<Duration> = Some(Duration::from_secs(60));

/// The first GPU's default stream, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<Arc<CudaStream>> {
    let reason = match cuda::device_count() {
        Ok(0) => "no CUDA device".to_string(),
        Ok(_) => match CudaContext::new(0) {
            Ok(ctx) => return Some(ctx.default_stream()),
            Err(e) => format!("cannot open cuda:0: {e}"),
        },
        Err(e) => e.to_string(),
    };
    if std::env::var_os("NIXL_CONNECT_REQUIRE_GPU").is_some() {
        panic!("{test}: a GPU is required here (NIXL_CONNECT_REQUIRE_GPU) but: {reason}");
    }
    // Straight to the stderr handle: libtest captures println!/eprintln!, and a skip must show.
    let _ = writeln!(std::io::stderr(), "{test}: skipped: {reason}");
    None
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

/// Which memory each side of a pairing uses.
#[derive(Clone, Copy, Debug)]
enum Mem {
    Host,
    /// `cuMemAlloc` memory (legacy CUDA IPC).
    Vram,
    /// The library's `DeviceBuffer` (a VMM allocation: crosses PID namespaces).
    Vmm,
}

/// Passive memory of `len` bytes in `n` descriptors holding `data` (or zeros), as descriptors.
fn alloc(s: &Arc<CudaStream>, kind: Mem, data: &[u8], n: usize) -> Vec<Descriptor<'static>> {
    let each = data.len() / n;
    (0..n)
        .map(|i| {
            let chunk = &data[i * each..if i + 1 == n { data.len() } else { (i + 1) * each }];
            match kind {
                Mem::Host => Descriptor::from(chunk.to_vec()),
                Mem::Vram => vram(s, chunk),
                Mem::Vmm => vmm(chunk),
            }
        })
        .collect()
}

/// Device memory from `cuMemAlloc` (as PyTorch's caching allocator takes it), freed on drop.
/// cudarc's own allocations come from the stream-ordered pool on this hardware, which legacy CUDA
/// IPC handles cannot share (such memory takes NIXL; docs/GPU.md).
struct DevMem {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: frees the allocation made by `vram`, which no transfer uses any more (the
        // descriptor owning this is dropped only once no transport can touch the memory).
        unsafe { cudarc::driver::sys::cuMemFree_v2(self.ptr) };
    }
}

/// A descriptor owning fresh device memory holding `data`.
fn vram(s: &Arc<CudaStream>, data: &[u8]) -> Descriptor<'static> {
    use cudarc::driver::sys;
    s.context().bind_to_thread().unwrap();
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: allocates and fills (synchronously) `data.len()` bytes in the bound context.
    unsafe {
        assert_eq!(
            sys::cuMemAlloc_v2(&mut ptr, data.len().max(1)),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    let owner = DevMem {
        ctx: s.context().clone(),
        ptr,
    };
    // SAFETY: `owner` keeps the allocation alive as long as the descriptor needs it.
    unsafe { Descriptor::from_raw_parts_with_owner(ptr as *mut u8, data.len(), Device::Cuda(0), true, owner) }
}

/// A descriptor owning a fresh `DeviceBuffer` holding `data`.
fn vmm(data: &[u8]) -> Descriptor<'static> {
    let mut b = cuda::DeviceBuffer::new(Device::Cuda(0), data.len()).unwrap();
    b.copy_from_host(data).unwrap();
    let ptr = b.ptr();
    // SAFETY: the buffer, owned by the descriptor, keeps the memory alive as long as it needs it.
    unsafe { Descriptor::from_raw_parts_with_owner(ptr as *mut u8, data.len(), Device::Cuda(0), true, b) }
}

/// Copies the descriptors' bytes back to the host (device memory through cudarc).
fn bytes_of(s: &Arc<CudaStream>, descs: &[Descriptor<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for d in descs {
        match d.as_slice() {
            Some(b) => out.extend_from_slice(b),
            None => {
                let mut host = vec![0u8; d.size()];
                // SAFETY: the descriptor's device memory is live and d.size() bytes long.
                let r = unsafe {
                    cudarc::driver::sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), d.ptr() as u64, d.size())
                };
                assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
                out.extend_from_slice(&host);
            }
        }
    }
    s.synchronize().unwrap();
    out
}

async fn pair(s: &Arc<CudaStream>, passive: Mem, active: Mem, write: bool, len: usize, n: usize) {
    let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
    let data = pattern(len, n as u8);
    let zeros = vec![0u8; len];
    if write {
        let w = a.create_writable(alloc(s, passive, &zeros, n)).await.unwrap();
        let op = b
            .begin_write(alloc(s, active, &data, n), w.metadata())
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        w.wait_for_completion(T).await.unwrap();
        assert!(
            bytes_of(s, w.descriptors()) == data,
            "write {passive:?} <- {active:?} {len} x{n}"
        );
    } else {
        let r = a.create_readable(alloc(s, passive, &data, n)).await.unwrap();
        let op = b
            .begin_read(r.metadata(), alloc(s, active, &zeros, n))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
        assert!(
            bytes_of(s, op.results()) == data,
            "read {active:?} <- {passive:?} {len} x{n}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_vram_to_vram_in_process() {
    let Some(s) = gpu("gpu_vram_to_vram_in_process") else {
        return;
    };
    for write in [false, true] {
        for (len, n) in [(4096, 1), (64 << 20, 1), (1 << 20, 8)] {
            pair(&s, Mem::Vram, Mem::Vram, write, len, n).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_host_and_vram_mixes_in_process() {
    let Some(s) = gpu("gpu_host_and_vram_mixes_in_process") else {
        return;
    };
    for write in [false, true] {
        for (passive, active) in [(Mem::Vram, Mem::Host), (Mem::Host, Mem::Vram)] {
            pair(&s, passive, active, write, 1 << 20, 1).await;
            pair(&s, passive, active, write, 1 << 20, 8).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_vram_into_pageable_host_is_staged_byte_exact() {
    let Some(s) = gpu("gpu_vram_into_pageable_host_is_staged_byte_exact") else {
        return;
    };
    // Pieces of 4 MiB and more from device memory into pageable host memory go through pinned
    // staging lanes (4 MiB chunks): a last chunk shorter than the rest, several pieces of one
    // operation, one piece under the threshold beside staged ones; reads and writes, in one
    // process and across two.
    let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
    for (len, n) in [
        ((9 << 20) + 4097, 1),
        (3 * ((5 << 20) + 13), 3),
        ((64 << 20) + 1, 2),
        ((12 << 20) + 2, 4),
    ] {
        let data = pattern(len, n as u8 + 40);
        let what = format!("{len} x{n}");
        let r = a.create_readable(alloc(&s, Mem::Vram, &data, n)).await.unwrap();
        let op = b
            .begin_read(r.metadata(), alloc(&s, Mem::Host, &vec![0u8; len], n))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
        assert_eq!(op.path(), Some(TransferPath::SameHost), "read {what}");
        assert!(bytes_of(&s, op.results()) == data, "read {what}: bytes differ");
        let w = a
            .create_writable(alloc(&s, Mem::Host, &vec![0u8; len], n))
            .await
            .unwrap();
        let op = b
            .begin_write(alloc(&s, Mem::Vram, &data, n), w.metadata())
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        w.wait_for_completion(T).await.unwrap();
        assert_eq!(op.path(), Some(TransferPath::SameHost), "write {what}");
        assert!(
            bytes_of(&s, w.descriptors()) == data,
            "write {what}: bytes differ"
        );
    }
    let len = (40 << 20) + 333;
    let mut peer = Peer::start(&format!("readable {len} 1 vram"));
    let md = peer.metadata();
    let op = b
        .begin_read(&md, alloc(&s, Mem::Host, &vec![0u8; len], 1))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::SameHost), "across two processes");
    assert!(
        bytes_of(&s, op.results()) == pattern(len, 1),
        "across two processes: bytes differ"
    );
    peer.finish("staged read across two processes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_device_claims_are_checked() {
    let Some(s) = gpu("gpu_device_claims_are_checked") else {
        return;
    };
    let slice = s.alloc_zeros::<u8>(4096).unwrap();
    let d = Descriptor::from_cuda_ref(&slice).unwrap();
    let ptr = d.ptr() as u64;
    assert_eq!(d.device(), Device::Cuda(0));
    // SAFETY: the descriptors are rejected before use; the memory outlives them.
    let as_cpu = unsafe { Descriptor::from_raw_cuda(ptr, 4096, Device::Host) };
    assert!(matches!(as_cpu, Err(Error::DeviceMismatch { .. })), "{as_cpu:?}");
    // SAFETY: as above.
    let wrong = unsafe { Descriptor::from_raw_cuda(ptr, 4096, Device::Cuda(1)) };
    assert!(matches!(wrong, Err(Error::DeviceMismatch { .. })), "{wrong:?}");
    // A raw descriptor that lies is caught when an operation is created.
    let conn = Connector::new().unwrap();
    // SAFETY: as above.
    let raw = unsafe { Descriptor::from_raw_parts(ptr as *mut u8, 4096, Device::Host) };
    let e = conn.create_readable(raw).await.unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    // Mixed kinds in one operation are refused, as in Python.
    let e = conn
        .create_readable(vec![Descriptor::from(vec![0u8; 16]), d])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("mixes device kinds"), "{e}");
}

/// A peer process running `support_gpu_peer` with `spec`; its stdout is read line by line.
struct Peer {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Peer {
    fn start(spec: &str) -> Self {
        Self::spawn(std::process::Command::new(std::env::current_exe().unwrap()), spec)
    }

    /// The peer in a pod: its own PID (with its own /proc), IPC and mount namespaces, finding
    /// this process's socket through the directory `dir` too.
    fn start_in_pod(spec: &str, dir: &std::path::Path) -> Self {
        let mut cmd = std::process::Command::new(POD[0]);
        cmd.args(&POD[1..])
            .arg(std::env::current_exe().unwrap())
            .env("NIXL_CONNECT_SOCKET_DIR", dir);
        Self::spawn(cmd, spec)
    }

    /// `cmd` (this test binary, or a command that runs it) as the peer `spec` names.
    fn spawn(mut cmd: std::process::Command, spec: &str) -> Self {
        let mut child = cmd
            .args([
                "gpu::support_gpu_peer",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("NIXL_CONNECT_TEST_PEER", spec)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        Self { child, out }
    }

    fn metadata(&mut self) -> RdmaMetadata {
        read_tagged(&mut self.out, "MD:").parse().unwrap()
    }

    fn finish(mut self, what: &str) {
        assert_eq!(read_tagged(&mut self.out, "DONE:"), "ok", "{what}");
        assert!(self.child.wait().unwrap().success(), "{what}");
    }
}

/// The path a same-host pair takes: always the same-host path (CUDA IPC when the source is device
/// memory, cross-memory attach through pinned staging for host memory into device memory).
fn expected_path(_source: Mem, _destination: Mem) -> TransferPath {
    TransferPath::SameHost
}

fn mem_name(m: Mem) -> &'static str {
    match m {
        Mem::Host => "host",
        Mem::Vram => "vram",
        Mem::Vmm => "vmm",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_vram_across_two_processes() {
    let Some(s) = gpu("gpu_vram_across_two_processes") else {
        return;
    };
    let conn = Connector::new().unwrap();
    for (role, len, n) in [
        ("readable", 64 << 20, 1),
        ("readable", 1 << 20, 8),
        ("writable", 64 << 20, 1),
        ("writable", 1 << 20, 8),
    ] {
        let mut peer = Peer::start(&format!("{role} {len} {n} vram"));
        let md = peer.metadata();
        let data = pattern(len, n as u8);
        if role == "readable" {
            let op = conn
                .begin_read(&md, alloc(&s, Mem::Vram, &vec![0u8; len], n))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            assert_eq!(op.path(), Some(TransferPath::SameHost), "{role}: CUDA IPC");
            assert!(bytes_of(&s, op.results()) == data, "{role} {len} x{n}");
        } else {
            let op = conn
                .begin_write(alloc(&s, Mem::Vram, &data, n), &md)
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            assert_eq!(op.path(), Some(TransferPath::SameHost), "{role}: CUDA IPC");
        }
        peer.finish(&format!("{role} {len} x{n}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_every_mix_and_direction_across_two_processes() {
    let Some(s) = gpu("gpu_ipc_every_mix_and_direction_across_two_processes") else {
        return;
    };
    let conn = Connector::new().unwrap();
    for role in ["readable", "writable"] {
        for (passive, active) in [
            (Mem::Vram, Mem::Vram),
            (Mem::Vram, Mem::Host),
            (Mem::Host, Mem::Vram),
        ] {
            for (len, n) in [(4096, 1), (64 << 20, 1), (1 << 20, 8)] {
                let what = format!("{role} on {passive:?} with the active side on {active:?}, {len} x{n}");
                let mut peer = Peer::start(&format!("{role} {len} {n} {}", mem_name(passive)));
                let md = peer.metadata();
                let data = pattern(len, n as u8);
                let (path, got) = if role == "readable" {
                    let op = conn
                        .begin_read(&md, alloc(&s, active, &vec![0u8; len], n))
                        .await
                        .unwrap();
                    op.wait_for_completion(T).await.unwrap();
                    (op.path(), Some(bytes_of(&s, op.results())))
                } else {
                    let op = conn.begin_write(alloc(&s, active, &data, n), &md).await.unwrap();
                    op.wait_for_completion(T).await.unwrap();
                    (op.path(), None)
                };
                if let Some(got) = got {
                    assert!(got == data, "{what}: bytes differ");
                }
                let (src, dst) = if role == "readable" {
                    (passive, active)
                } else {
                    (active, passive)
                };
                assert_eq!(path, Some(expected_path(src, dst)), "{what}");
                peer.finish(&what);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_reallocated_memory_is_never_read_through_a_stale_mapping() {
    let Some(s) = gpu("gpu_ipc_reallocated_memory_is_never_read_through_a_stale_mapping") else {
        return;
    };
    // The peer frees its buffer after each read and allocates a new one (the allocator usually
    // hands back the same address) holding other bytes: every read must see the new bytes.
    let conn = Connector::new().unwrap();
    let len = 1 << 20;
    let mut peer = Peer::start(&format!("realloc {len} 6 vram"));
    for round in 0..6u8 {
        let md = peer.metadata();
        let op = conn
            .begin_read(&md, alloc(&s, Mem::Vram, &vec![0u8; len], 1))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        assert!(
            bytes_of(&s, op.results()) == pattern(len, 100 + round),
            "round {round}: stale bytes"
        );
    }
    peer.finish("realloc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_owner_killed_mid_copy_is_a_typed_error() {
    let Some(s) = gpu("gpu_ipc_owner_killed_mid_copy_is_a_typed_error") else {
        return;
    };
    let conn = Connector::new().unwrap();
    let len = 1 << 30;
    let mut peer = Peer::start(&format!("readable {len} 1 vram"));
    let md = peer.metadata();
    let op = conn
        .begin_read(&md, alloc(&s, Mem::Vram, &vec![0u8; len], 1))
        .await
        .unwrap();
    peer.child.kill().unwrap();
    let _ = peer.child.wait();
    // Finished before the kill landed, or a typed error: never a hang or a crash.
    match op.wait_for_completion(T).await {
        Ok(()) => {}
        Err(e) => assert!(
            matches!(
                e,
                Error::RemoteGone { .. } | Error::Transfer { .. } | Error::Refused { .. }
            ),
            "{e}"
        ),
    }
    drop(op);
    // The connector still works.
    let r = conn
        .create_readable(alloc(&s, Mem::Vram, &pattern(4096, 1), 1))
        .await
        .unwrap();
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_copier_killed_mid_copy_leaves_the_owner_sound() {
    let Some(s) = gpu("gpu_ipc_copier_killed_mid_copy_leaves_the_owner_sound") else {
        return;
    };
    let conn = Connector::new().unwrap();
    let len = 1 << 30;
    let data = pattern(len, 7);
    let r = conn
        .create_readable(alloc(&s, Mem::Vram, &data, 1))
        .await
        .unwrap();
    let mut peer = Peer::start(&format!("read {len} 1 vram"));
    {
        use std::io::Write as _;
        let stdin = peer.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{}", r.metadata().to_json()).unwrap();
        stdin.flush().unwrap();
    }
    peer.child.kill().unwrap();
    let _ = peer.child.wait();
    // The reader died: the readable completed (its Done arrived first) or does not complete;
    // either way it ends within the deadline, and its memory is intact.
    let _ = r.wait_for_completion(Some(Duration::from_secs(5))).await;
    assert!(
        bytes_of(&s, r.descriptors()) == data,
        "the owner's memory changed"
    );
    drop(r);
}

/// Device memory between pods (issue 41): the peer in its own PID, IPC and mount namespaces
/// (legacy CUDA IPC handles do not open there). The library's `DeviceBuffer` moves on the
/// same-host path as a VMM allocation's descriptor (`cuda-vmm`), read and written, one and
/// several allocations per operation, into device and host memory, bytes checked on the side
/// that receives them; `cuMemAlloc` memory as the source takes NIXL, bytes still right. In one
/// namespace VMM memory goes as a descriptor too, legacy memory as a handle; a buffer freed and
/// allocated again in the pod is never read through the old mapping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_vmm_device_memory_crosses_pid_and_ipc_namespaces() {
    let Some(s) = gpu("gpu_vmm_device_memory_crosses_pid_and_ipc_namespaces") else {
        return;
    };
    use nixl_connect::Mechanism;
    let dir = std::env::temp_dir().join(format!("nxc-gpu-pods-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let conn = Connector::builder().socket_dir(&dir).build().unwrap();
    let (vmm, ipc) = (Some(Mechanism::CudaVmm), Some(Mechanism::CudaIpc));
    for (pod, role, passive, active, len, n, want) in [
        (true, "readable", Mem::Vmm, Mem::Vmm, 64 << 20, 1, vmm),
        (true, "readable", Mem::Vmm, Mem::Vmm, 1 << 20, 3, vmm),
        (true, "readable", Mem::Vmm, Mem::Host, 8 << 20, 1, vmm),
        (true, "writable", Mem::Vmm, Mem::Vmm, 64 << 20, 1, vmm),
        (true, "writable", Mem::Vram, Mem::Vmm, 1 << 20, 2, vmm),
        // Legacy memory as the source: NIXL, with the reason in the logs.
        (true, "readable", Mem::Vram, Mem::Vmm, 1 << 20, 1, None),
        // One namespace: VMM memory has no legacy handle; it goes as a descriptor there too,
        // legacy memory as a handle.
        (false, "readable", Mem::Vmm, Mem::Vram, 8 << 20, 1, vmm),
        (false, "writable", Mem::Vram, Mem::Vmm, 8 << 20, 1, vmm),
        (false, "readable", Mem::Vram, Mem::Vmm, 8 << 20, 1, ipc),
    ] {
        let at = if pod { "in a pod" } else { "in this namespace" };
        let what = format!("{role} on {passive:?} {at}, the active side on {active:?}, {len} x{n}");
        let spec = format!("{role} {len} {n} {}", mem_name(passive));
        let mut peer = if pod {
            Peer::start_in_pod(&spec, &dir)
        } else {
            Peer::start(&spec)
        };
        let md = peer.metadata();
        let data = pattern(len, n as u8);
        let (path, mechanism) = if role == "readable" {
            let op = conn
                .begin_read(&md, alloc(&s, active, &vec![0u8; len], n))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            assert!(bytes_of(&s, op.results()) == data, "{what}: bytes differ");
            (op.path(), op.mechanism())
        } else {
            let op = conn.begin_write(alloc(&s, active, &data, n), &md).await.unwrap();
            op.wait_for_completion(T).await.unwrap();
            (op.path(), op.mechanism())
        };
        let want_path = if want.is_some() {
            TransferPath::SameHost
        } else {
            TransferPath::Nixl
        };
        assert_eq!(path, Some(want_path), "{what}");
        assert_eq!(mechanism, want, "{what}");
        peer.finish(&what); // a writable's owner checks every byte
    }
    // The owner in a pod frees its buffer after each read and allocates another (a new
    // allocation, often at the same address): every read sees the new bytes, never a mapping
    // kept of the old one.
    let len = 1 << 20;
    let mut peer = Peer::start_in_pod(&format!("realloc {len} 6 vmm"), &dir);
    for round in 0..6u8 {
        let md = peer.metadata();
        let op = conn
            .begin_read(&md, alloc(&s, Mem::Vmm, &vec![0u8; len], 1))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        assert_eq!(op.mechanism(), vmm, "round {round}");
        assert!(
            bytes_of(&s, op.results()) == pattern(len, 100 + round),
            "round {round}: stale bytes"
        );
    }
    peer.finish("realloc in a pod");
    let _ = std::fs::remove_dir_all(&dir);
}

fn read_tagged(out: &mut impl std::io::BufRead, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "peer exited before {tag}");
        if let Some(i) = line.find(tag) {
            return line[i + tag.len()..].trim_end().to_string();
        }
    }
}

/// The peer, on cuda:0: `readable|writable LEN N MEM` (MEM `vram` or `host`) exposes and waits;
/// `realloc LEN ROUNDS vram` exposes a fresh allocation per round; `read LEN N MEM` reads the
/// metadata line on stdin into fresh memory.
#[test]
#[ignore = "run by the gpu tests as their peer"]
fn support_gpu_peer() {
    let Ok(spec) = std::env::var("NIXL_CONNECT_TEST_PEER") else {
        return;
    };
    let w: Vec<&str> = spec.split_whitespace().collect();
    let (len, n): (usize, usize) = (w[1].parse().unwrap(), w[2].parse().unwrap());
    let mem = match w.get(3) {
        Some(&"host") => Mem::Host,
        Some(&"vmm") => Mem::Vmm,
        _ => Mem::Vram,
    };
    let s = CudaContext::new(0).unwrap().default_stream();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let say = |tag: &str, v: &str| {
        println!("{tag}{v}");
        std::io::stdout().flush().unwrap();
    };
    rt.block_on(async {
        let conn = Connector::new().unwrap();
        let data = pattern(len, n as u8);
        let ok = match w[0] {
            "readable" => {
                let r = conn.create_readable(alloc(&s, mem, &data, n)).await.unwrap();
                say("MD:", &r.metadata().to_json());
                r.wait_for_completion(T).await.unwrap();
                true
            }
            "writable" => {
                let r = conn
                    .create_writable(alloc(&s, mem, &vec![0u8; len], n))
                    .await
                    .unwrap();
                say("MD:", &r.metadata().to_json());
                r.wait_for_completion(T).await.unwrap();
                bytes_of(&s, r.descriptors()) == data
            }
            "realloc" => {
                for round in 0..n as u8 {
                    let r = conn
                        .create_readable(alloc(&s, mem, &pattern(len, 100 + round), 1))
                        .await
                        .unwrap();
                    say("MD:", &r.metadata().to_json());
                    r.wait_for_completion(T).await.unwrap();
                    drop(r); // frees the allocation; the next round's is new
                }
                true
            }
            "read" => {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).unwrap();
                let md: RdmaMetadata = line.trim().parse().unwrap();
                let op = conn
                    .begin_read(&md, alloc(&s, mem, &vec![0u8; len], n))
                    .await
                    .unwrap();
                op.wait_for_completion(T).await.is_ok()
            }
            other => panic!("unknown peer role {other}"),
        };
        say("DONE:", if ok { "ok" } else { "BAD" });
    });
}
