//! What a user's own tests get from `nixl_connect::testing`: connectors that pair in process,
//! with no NIXL library loaded (nor needed), and whose metadata no other transport mistakes for
//! its own.

use std::time::Duration;

use nixl_connect::{
    Connector, Descriptor, Error, MetadataProblem, OperationStatus, RdmaMetadata, TransferPath,
};

const T: Option<Duration> = Some(Duration::from_secs(5));

/// Whether this process has mapped any NIXL library.
fn nixl_mapped() -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .contains("libnixl")
}

#[tokio::test]
async fn loopback_moves_bytes_with_no_nixl_library_loaded() {
    let a = Connector::builder().worker_id("enc").build_loopback().unwrap();
    let b = Connector::builder()
        .worker_id("prefill")
        .build_loopback()
        .unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7) as u8).collect();
    let r = a.create_readable(Descriptor::from(data.clone())).await.unwrap();
    // The published metadata is the model Dynamo's peers parse, carrying the loopback's own
    // reachability string.
    let json = r.metadata().to_json();
    let md: RdmaMetadata = json.parse().unwrap();
    assert_eq!(md.nixl_metadata, format!("loopback:{}", a.name()));
    let op = b
        .begin_read(&md, Descriptor::from(vec![0u8; data.len()]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::Loopback));
    assert_eq!(op.results()[0].as_slice().unwrap(), &data[..]);

    let w = b
        .create_writable(Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let op = a
        .begin_write(Descriptor::from(vec![5u8; 4096]), w.metadata())
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    w.wait_for_completion(T).await.unwrap();
    assert_eq!(w.status(), OperationStatus::Complete);
    assert!(w.into_descriptors()[0]
        .as_slice()
        .unwrap()
        .iter()
        .all(|&x| x == 5));

    assert!(!nixl_mapped(), "a loopback connector loaded NIXL");
    // Where the test command points NIXL_CONNECT_LIB at nothing, NIXL is indeed not loadable:
    // the loopback run above proves it was not needed.
    if std::env::var_os(nixl_connect::nixl_library::NIXL_LIB_ENV)
        .is_some_and(|p| !std::path::Path::new(&p).exists())
    {
        assert!(matches!(
            nixl_connect::nixl_library::load(),
            Err(Error::NixlNotFound { .. })
        ));
    }
}

#[tokio::test]
async fn loopback_refuses_metadata_it_cannot_read_before_any_transfer() {
    let b = Connector::builder().build_loopback().unwrap();
    let a = Connector::builder().build_loopback().unwrap();
    let r = a.create_readable(Descriptor::from(vec![1u8; 64])).await.unwrap();
    let nixl_style = RdmaMetadata {
        // What a NIXL connector publishes: a loopback connector cannot reach it.
        nixl_metadata: RdmaMetadata::encode_agent_metadata(b"nixlSerDes|..."),
        ..r.metadata().clone()
    };
    let empty_name = RdmaMetadata {
        nixl_metadata: "loopback:".into(),
        ..r.metadata().clone()
    };
    for md in [nixl_style, empty_name] {
        let e = b
            .begin_read(&md, Descriptor::from(vec![0u8; 64]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Metadata {
                    field: "nixl_metadata",
                    problem: MetadataProblem::NotLoopback,
                    ..
                }
            ),
            "{e}"
        );
    }
    assert_eq!(b.stats().await.unwrap().transfers, 0);
    assert_eq!(r.status(), OperationStatus::Initialized);
}

#[tokio::test]
async fn loopback_many_operations_at_once_each_complete_once() {
    let a = Connector::builder().build_loopback().unwrap();
    let b = Connector::builder().build_loopback().unwrap();
    let mut readables = Vec::new();
    for i in 0..64u8 {
        readables.push(a.create_readable(Descriptor::from(vec![i; 512])).await.unwrap());
    }
    let mut reads = Vec::new();
    for r in &readables {
        reads.push(
            b.begin_read(r.metadata(), Descriptor::from(vec![0u8; 512]))
                .await
                .unwrap(),
        );
    }
    for (i, (op, r)) in reads.iter().zip(&readables).enumerate() {
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
        assert!(op.results()[0].as_slice().unwrap().iter().all(|&x| x == i as u8));
    }
    assert_eq!(b.stats().await.unwrap().transfers, 64);
}
