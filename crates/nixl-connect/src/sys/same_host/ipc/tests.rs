//! The CUDA thread's checks that need a GPU (skipped without one, failed where
//! `NIXL_CONNECT_REQUIRE_GPU` is set).

use super::*;
use cudarc::driver::sys::CUresult;

/// The first GPU's context, or `None` after saying why the test is skipped (a failure where
/// `NIXL_CONNECT_REQUIRE_GPU` is set).
fn gpu(test: &str) -> Option<std::sync::Arc<cudarc::driver::CudaContext>> {
    if available() {
        if let Ok(ctx) = cudarc::driver::CudaContext::new(0) {
            return Some(ctx);
        }
    }
    assert!(
        std::env::var_os("NIXL_CONNECT_REQUIRE_GPU").is_none(),
        "{test}: a GPU is required here"
    );
    eprintln!("{test}: skipped: no usable CUDA device");
    None
}

#[test]
fn ipc_finding_a_peer_device_makes_no_context() {
    let Some(ctx) = gpu("ipc_finding_a_peer_device_makes_no_context") else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    let mut dev: sys::CUdevice = 0;
    let mut u = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: plain driver queries writing into the locals.
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuDeviceGetUuid_v2(&mut u, dev), CUresult::CUDA_SUCCESS);
    }
    let uuid = u.bytes.map(|b| b as u8);
    let mut cuda = Cuda::default();
    assert_eq!(cuda.ordinal_of(&uuid).unwrap(), 0);
    assert!(
        cuda.devs.is_empty(),
        "no context or stream was made to compare UUIDs"
    );
    let mut unknown = uuid;
    unknown[0] ^= 0xff;
    assert!(matches!(
        cuda.ordinal_of(&unknown),
        Err(IpcError::PeerGpuNotVisible)
    ));
    assert!(cuda.devs.is_empty());
}

/// VMM exports: one descriptor per allocation (ranges in one share it) under an id kept per
/// connection while the allocation is shared (a new id once it is given back), mapped by an
/// importer once per id and at the allocation's true size only, the bytes the exporter's;
/// legacy memory goes as a legacy handle in one PID namespace and cannot go to another;
/// what a connection keeps shared is bounded.
#[test]
fn ipc_vmm_exports_are_kept_per_connection_and_mapped_once() {
    let Some(ctx) = gpu("ipc_vmm_exports_are_kept_per_connection_and_mapped_once") else {
        return;
    };
    use crate::cuda::DeviceBuffer;
    use crate::device::Device;
    let pods = ExportAs::Descriptors {
        other_namespace: true,
    };
    let same = ExportAs::Descriptors {
        other_namespace: false,
    };
    let mut a = DeviceBuffer::new(Device::Cuda(0), 4 << 20).unwrap();
    let b = DeviceBuffer::new(Device::Cuda(0), 4096).unwrap();
    let bytes: Vec<u8> = (0..4 << 20)
        .map(|i: usize| (i as u8).wrapping_mul(7) ^ (i >> 12) as u8)
        .collect();
    a.copy_from_host(&bytes).unwrap();
    let mut cuda = Cuda::default();
    let ranges = [
        (a.ptr(), 1 << 20),
        (a.ptr() + (2 << 20), 1 << 20),
        (b.ptr(), 4096),
    ];
    let (sources, fds) = cuda.export_as(1, &ranges, pods).unwrap();
    assert_eq!(fds.len(), 2, "two allocations");
    assert_eq!(sources.iter().map(|s| s.fd).collect::<Vec<_>>(), [1, 1, 2]);
    assert!(fds.iter().all(crate::sys::same_host::is_cuda_export));
    assert_eq!((sources[1].offset, sources[0].alloc_len), (2 << 20, 4 << 20));
    let id_a = sources[0].buffer_id;
    // Again on the same connection: the same ids; on another: ids of its own.
    let (again, _) = cuda.export_as(1, &ranges[..1], pods).unwrap();
    assert_eq!(again[0].buffer_id, id_a);
    let (other, _) = cuda.export_as(2, &ranges[..1], pods).unwrap();
    assert_ne!(other[0].buffer_id, id_a);
    // One PID namespace: memory without a legacy handle still goes as a descriptor.
    let (s1, f1) = cuda.export_as(3, &ranges[..1], same).unwrap();
    assert_eq!((s1[0].fd, f1.len()), (1, 1));
    // Imported once per id, at its true size: the exporter's bytes.
    let d = cuda.dev(0).unwrap();
    let p1 = cuda.vmm_map(9, &sources[1], &fds[0], 0, d.ctx).unwrap();
    let p2 = cuda.vmm_map(9, &sources[0], &fds[0], 0, d.ctx).unwrap();
    assert_eq!((p1, cuda.imports.len()), (p2, 1), "one mapping per export id");
    cuda.run(Job::Unmap(9, vec![id_a + 1000]));
    assert_eq!(cuda.imports.len(), 1, "another id's");
    cuda.run(Job::Unmap(9, vec![id_a]));
    assert!(cuda.imports.is_empty(), "given back by its exporter");
    let p1 = cuda.vmm_map(9, &sources[1], &fds[0], 0, d.ctx).unwrap();
    cuda.within_mapping(d.ctx, p1, &sources[1]).unwrap();
    let mut back = vec![0u8; 1 << 20];
    ctx.bind_to_thread().unwrap();
    // SAFETY: copies 1 MiB out of the mapping (inside the allocation) into `back`.
    let r = unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p1 + (2 << 20), 1 << 20) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    assert!(back == bytes[2 << 20..3 << 20], "the exporter's bytes");
    // The same id claimed with another size: that mapping goes, and none of that size maps.
    let mut lie = sources[0].clone();
    lie.alloc_len = 8 << 20;
    assert!(cuda.vmm_map(9, &lie, &fds[0], 0, d.ctx).is_err());
    assert!(cuda.imports.is_empty());
    assert!(
        vmm::Imported::map(&fds[1], 4 << 20, 0).is_err(),
        "4 KiB's allocation is 2 MiB"
    );
    // Given back (a dropped buffer): the next export of the address is a new allocation's.
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    cuda.tellers.insert(
        1,
        Arc::new(move |c, ids| tx.lock().recover().send((c, ids)).unwrap()),
    );
    cuda.unshare(|_, s| s.base == a.ptr());
    assert_eq!(
        rx.try_recv().unwrap(),
        (1, vec![id_a]),
        "the peer is told at once"
    );
    let (fresh, _) = cuda.export_as(1, &ranges[..1], pods).unwrap();
    assert!(fresh[0].buffer_id > id_a);
    assert!(rx.try_recv().is_err(), "once");
    // Legacy memory: a handle in one namespace, nothing to another.
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: allocates 1 MiB with cuMemAlloc; freed below.
    let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, 1 << 20) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let (legacy, lf) = cuda.export_as(1, &[(ptr, 4096)], same).unwrap();
    assert_eq!((legacy[0].fd, lf.len()), (0, 0));
    let e = cuda.export_as(1, &[(ptr, 4096)], pods).unwrap_err();
    assert!(matches!(e, IpcError::NotExportable), "{e}");
    // More allocations than one frame passes; more than a connection keeps.
    let many: Vec<DeviceBuffer> = (0..MAX_SHARED_PER_CONN + 2)
        .map(|_| DeviceBuffer::new(Device::Cuda(0), 4096).unwrap())
        .collect();
    let five: Vec<(u64, u64)> = many[..5].iter().map(|m| (m.ptr(), 4096)).collect();
    assert!(matches!(
        cuda.export_as(4, &five, pods),
        Err(IpcError::TooManyAllocations(4))
    ));
    for m in &many {
        cuda.export_as(4, &[(m.ptr(), 4096)], pods).unwrap();
    }
    assert_eq!(
        cuda.shared.keys().filter(|k| k.0 == 4).count(),
        MAX_SHARED_PER_CONN
    );
    // A connection closed gives back all it kept.
    cuda.run(Job::Forget(4));
    assert_eq!(cuda.shared.keys().filter(|k| k.0 == 4).count(), 0);
    ctx.bind_to_thread().unwrap();
    // SAFETY: frees the allocation made above.
    unsafe { sys::cuMemFree_v2(ptr) };
}

#[test]
fn ipc_mapping_size_refuses_a_peer_claiming_more_than_it_exported() {
    let Some(ctx) = gpu("ipc_mapping_size_refuses_a_peer_claiming_more_than_it_exported") else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: allocates 1 MiB with cuMemAlloc (IPC handles need such memory, not the stream
    // pool's that cudarc allocates from); freed at the end.
    let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, 1 << 20) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let mut cuda = Cuda::default();
    let honest = cuda.export(&[(ptr, 1 << 20)]).unwrap().remove(0);
    let d = cuda.dev(0).unwrap();
    cuda.within_mapping(d.ctx, honest.base, &honest).unwrap();
    // The peer's word: a larger allocation, and a range running past the real one.
    let mut forged = honest.clone();
    forged.alloc_len = 64 << 20;
    forged.len = 2 << 20;
    let e = cuda.within_mapping(d.ctx, forged.base, &forged).unwrap_err();
    assert!(matches!(e, IpcError::LargerThanMapping { .. }), "{e}");
    // Claiming a larger allocation alone is refused too.
    let mut bigger = honest.clone();
    bigger.alloc_len = 2 << 20;
    assert!(cuda.within_mapping(d.ctx, bigger.base, &bigger).is_err());
    ctx.bind_to_thread().unwrap();
    // SAFETY: frees the allocation made above; nothing uses it any more.
    unsafe { sys::cuMemFree_v2(ptr) };
}
