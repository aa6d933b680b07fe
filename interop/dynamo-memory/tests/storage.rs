//! Descriptors over `dynamo-memory` storage, read and written by real nixl-connect operations
//! (real NIXL, loaded at run time: `NIXL_CONNECT_LIB`), over NIXL and over the same-host path,
//! every byte checked. Device storage needs a GPU: without one that case prints why it skipped.

use std::time::Duration;

use dynamo_memory::{Buffer, DeviceStorage, StorageKind, SystemStorage};
use nixl_connect::{Connector, Descriptor, Device, PathPolicy, TransferPath};
use nixl_connect_dynamo_memory::{descriptor, descriptor_of, device_of, Unsupported};

const T: Option<Duration> = Some(Duration::from_secs(60));

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Host storage holding `data`.
fn system(data: &[u8]) -> SystemStorage {
    let mut s = SystemStorage::new(data.len()).unwrap();
    // SAFETY: the storage is data.len() bytes, owned here, with no other reference yet.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), s.as_mut_ptr(), data.len()) };
    s
}

fn bytes(d: &[Descriptor<'_>]) -> Vec<u8> {
    d[0].as_slice().expect("host storage").to_vec()
}

fn pair(path: PathPolicy) -> (Connector, Connector) {
    let make = || Connector::builder().path(path).build().unwrap();
    (make(), make())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_system_memory_read_and_written_over_both_paths() {
    for (path, expect) in [
        (PathPolicy::Nixl, TransferPath::Nixl),
        (PathPolicy::Auto, TransferPath::SameHost),
    ] {
        let (owner, peer) = pair(path);
        let len = (1 << 20) + 123;
        // Read: the owner exposes its storage, the peer reads into its own.
        let r = owner
            .create_readable(vec![descriptor(system(&pattern(len, 1)))])
            .await
            .unwrap();
        let op = peer
            .begin_read(r.metadata(), vec![descriptor(system(&vec![0; len]))])
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
        assert_eq!(op.path(), Some(expect), "{path:?}");
        let got = op.into_descriptors().ok().unwrap();
        assert!(bytes(&got) == pattern(len, 1), "read over {path:?}: bytes differ");
        // Write: the peer writes its storage into the owner's.
        let w = owner
            .create_writable(vec![descriptor(system(&vec![0; len]))])
            .await
            .unwrap();
        let op = peer
            .begin_write(vec![descriptor(system(&pattern(len, 2)))], w.metadata())
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        w.wait_for_completion(T).await.unwrap();
        assert_eq!(op.path(), Some(expect), "{path:?}");
        assert!(
            bytes(&w.into_descriptors()) == pattern(len, 2),
            "write over {path:?}: bytes differ"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_buffer_descriptor_keeps_the_storage_alive() {
    // The only Buffer handle is dropped while an operation holds its descriptor: the memory stays
    // valid (the descriptor owns a clone) and the read completes with the right bytes.
    let (owner, peer) = pair(PathPolicy::Auto);
    let len = 64 << 10;
    let src = Buffer::new(system(&pattern(len, 3)));
    // SAFETY: dynamo-memory's own storage, in no other operation.
    let d = unsafe { descriptor_of(&src) }.unwrap();
    let r = owner.create_readable(vec![d]).await.unwrap();
    drop(src);
    let op = peer
        .begin_read(r.metadata(), vec![descriptor(system(&vec![0; len]))])
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert!(bytes(&op.into_descriptors().ok().unwrap()) == pattern(len, 3));
}

#[test]
fn storage_kinds_map_to_devices() {
    assert_eq!(device_of(StorageKind::System), Ok(Device::Host));
    assert_eq!(device_of(StorageKind::Pinned), Ok(Device::Host));
    assert_eq!(device_of(StorageKind::Device(3)), Ok(Device::Cuda(3)));
    let e = device_of(StorageKind::Disk(7)).unwrap_err();
    assert_eq!(e, Unsupported::Disk(7));
    assert!(e.to_string().contains("read it into"), "{e}");
    let d = descriptor(system(&[1, 2, 3]));
    assert_eq!((d.size(), d.device()), (3, Device::Host));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_device_memory_read_from_host_storage() {
    let len = 4 << 20;
    // dynamo-memory's cudarc panics where there is no CUDA driver to load: that is a skip here.
    // (nixl-connect's `cuda` feature cannot be in this build: see README.md.)
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let gpu = std::panic::catch_unwind(|| DeviceStorage::new(len, 0));
    std::panic::set_hook(hook);
    let gpu = match gpu {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("no CUDA driver library (libcuda) to load".to_string()),
    };
    let dev = match gpu {
        Ok(d) => Buffer::new(d),
        Err(e) => {
            if std::env::var_os("NIXL_CONNECT_REQUIRE_GPU").is_some() {
                panic!("a GPU is required here (NIXL_CONNECT_REQUIRE_GPU) but: {e}");
            }
            eprintln!("storage_device_memory_read_from_host_storage: skipped: {e}");
            return;
        }
    };
    let (owner, peer) = pair(PathPolicy::Auto);
    let r = owner
        .create_readable(vec![descriptor(system(&pattern(len, 4)))])
        .await
        .unwrap();
    // SAFETY: dynamo-memory's own device storage, in one operation at a time.
    let op = peer
        .begin_read(r.metadata(), vec![unsafe { descriptor_of(&dev) }.unwrap()])
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    drop(op);
    // Back to host storage through the same path, and compared.
    // SAFETY: as above; the read into it has ended.
    let r = peer
        .create_readable(vec![unsafe { descriptor_of(&dev) }.unwrap()])
        .await
        .unwrap();
    let op = owner
        .begin_read(r.metadata(), vec![descriptor(system(&vec![0; len]))])
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert!(
        bytes(&op.into_descriptors().ok().unwrap()) == pattern(len, 4),
        "device round trip: bytes differ"
    );
}
