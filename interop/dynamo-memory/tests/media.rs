//! nixl-connect reads what Dynamo's Rust media path publishes: the publication is made with
//! `dynamo-memory`'s own NIXL module the way `dynamo-llm`'s `preprocessor/media` does it
//! (`SystemStorage` holding the decoded pixels, `NixlAgent::with_backends(.., ["UCX"])`,
//! `nixl::register_with_nixl`, the agent's `get_local_md()` as `"b64:"` + base64 of zlib level 6,
//! `RegisteredView::descriptor()` serialised by serde), and read by a nixl-connect connector over
//! real NIXL, every byte checked.

use std::time::Duration;

use dynamo_memory::nixl::{register_with_nixl, NixlAgent, RegisteredView};
use dynamo_memory::SystemStorage;
use nixl_connect::{Connector, RdmaMetadata, TransferPath};
use nixl_connect_dynamo_memory::{descriptor, media};

fn pixels(h: usize, w: usize) -> Vec<u8> {
    (0..h * w * 3)
        .map(|i| (i % 251) as u8 ^ (i / 4096) as u8)
        .collect()
}

/// What Dynamo's frontend sends the next stage for a decoded `h` x `w` RGB image, and what keeps
/// the registration alive (the agent and the registered storage).
fn publish(agent: &NixlAgent, h: usize, w: usize) -> (serde_json::Value, impl Sized) {
    let data = pixels(h, w);
    let mut storage = SystemStorage::new(data.len()).unwrap();
    // SAFETY: the storage is data.len() bytes, owned here, with no other reference.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), storage.as_mut_ptr(), data.len()) };
    let registered = register_with_nixl(storage, agent.raw_agent(), None).expect("registered with NIXL");
    let md = agent.raw_agent().get_local_md().unwrap();
    let published = serde_json::json!({
        "nixl_metadata": RdmaMetadata::encode_agent_metadata(&md),
        "nixl_descriptor": serde_json::to_value(registered.descriptor()).unwrap(),
        "shape": [h, w, 3],
        "dtype": "UINT8",
        "metadata": null,
    });
    (published, registered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_publication_of_dynamo_memory_is_read_byte_exact() {
    // nixl-connect loads NIXL (by full path, before any nixl-sys call); Dynamo's agent then
    // resolves the same library, as in a process that holds both.
    let conn = Connector::new().unwrap();
    let agent = NixlAgent::with_backends(&format!("media-loader-{}", std::process::id()), &["UCX"]).unwrap();
    for (i, (h, w)) in [(480, 640), (1, 1), (1080, 1920)].into_iter().enumerate() {
        let (published, _kept) = publish(&agent, h, w);
        // The wire form: JSON text, as over NATS or a request payload.
        let wire = published.to_string();
        let got: serde_json::Value = serde_json::from_str(&wire).unwrap();
        assert_eq!(got["nixl_descriptor"]["mem_type"], "Dram", "{wire:.200}");
        let md = media::metadata(&got, &format!("media-read-{i}")).unwrap();
        let dst = descriptor(SystemStorage::new(h * w * 3).unwrap());
        let op = conn.begin_read(&md, vec![dst]).await.unwrap();
        op.wait_for_completion(Some(Duration::from_secs(60)))
            .await
            .unwrap();
        assert_eq!(op.path(), Some(TransferPath::Nixl));
        let got = op.into_descriptors().ok().unwrap();
        assert!(
            got[0].as_slice().unwrap() == pixels(h, w).as_slice(),
            "{h}x{w}: bytes differ"
        );
    }
}

#[test]
fn media_descriptor_that_is_not_dynamos_is_refused_with_the_field() {
    let ok = serde_json::json!({
        "nixl_metadata": "b64:eJw=",
        "nixl_descriptor": {"addr": 4096, "size": 12, "mem_type": "Dram", "device_id": 0},
    });
    assert!(media::metadata(&ok, "k").is_ok());
    let mut no_addr = ok.clone();
    no_addr["nixl_descriptor"]["addr"] = serde_json::json!("x");
    let e = media::metadata(&no_addr, "k").unwrap_err();
    assert!(e.to_string().contains("nixl_descriptor.addr"), "{e}");
    let mut file = ok.clone();
    file["nixl_descriptor"]["mem_type"] = serde_json::json!("File");
    assert!(matches!(
        media::metadata(&file, "k"),
        Err(media::MediaError::MemType(_))
    ));
    let mut zero = ok.clone();
    zero["nixl_descriptor"]["addr"] = serde_json::json!(0);
    assert!(
        media::metadata(&zero, "k").is_err(),
        "a zero address never validates"
    );
    let mut vram = ok;
    vram["nixl_descriptor"]["mem_type"] = serde_json::json!("Vram");
    vram["nixl_descriptor"]["device_id"] = serde_json::json!(2);
    let md = media::metadata(&vram, "k").unwrap();
    assert_eq!(md.descriptors[0].device, nixl_connect::Device::Cuda(2));
}
