//! Untrusted metadata: what a peer's `RdmaMetadata` can make this process keep.

use std::io::{Read, Write};

use base64::Engine as _;
use nixl_connect::{Connector, Descriptor, Error, RdmaMetadata};

use super::support::{run_support, runtime, PEER_ENV};

const MIB: usize = 1 << 20;

fn rss_mb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024
}

fn unpack(md: &str) -> Vec<u8> {
    let z = base64::engine::general_purpose::STANDARD
        .decode(md.strip_prefix("b64:").unwrap())
        .unwrap();
    let mut out = Vec::new();
    flate2::read::ZlibDecoder::new(&z[..])
        .read_to_end(&mut out)
        .unwrap();
    out
}

fn pack(raw: &[u8]) -> String {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(raw).unwrap();
    format!(
        "b64:{}",
        base64::engine::general_purpose::STANDARD.encode(z.finish().unwrap())
    )
}

#[test]
fn untrusted_inflating_metadata_is_refused_and_rss_stays_bounded() {
    let text = run_support("untrusted::support_inflating", &[]);
    assert!(text.contains("INFLATING-OK"), "{text}");
}

#[test]
#[ignore = "run by untrusted_inflating_metadata_is_refused_and_rss_stays_bounded in a fresh process"]
fn support_inflating() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let owner = Connector::new().unwrap();
        let reader = Connector::new().unwrap();
        let r = owner
            .create_readable(Descriptor::from(vec![7u8; 4096]))
            .await
            .unwrap();
        let good: RdmaMetadata = r.metadata().clone();
        let raw = unpack(&good.nixl_metadata);
        let before = rss_mb();
        let mut refused = 0;
        let mut accepted = 0;
        for i in 0..200u64 {
            // Valid at the front, zero-padded to 15 MiB, distinct per string.
            let mut blob = raw.clone();
            blob.resize(15 * MIB, 0);
            let n = blob.len();
            blob[n - 8..].copy_from_slice(&i.to_le_bytes());
            let mut md = good.clone();
            md.nixl_metadata = pack(&blob);
            match reader.begin_read(&md, Descriptor::from(vec![0u8; 4096])).await {
                Err(Error::Metadata { .. }) => refused += 1,
                Err(e) => panic!("string {i}: expected a metadata error, got {e}"),
                Ok(op) => {
                    accepted += 1;
                    drop(op);
                }
            }
        }
        let after = rss_mb();
        println!("rss before={before} MB after={after} MB refused={refused} accepted={accepted}");
        assert_eq!(refused, 200, "zero-padded agent metadata must be refused");
        assert!(after < 600, "200 inflating strings left RSS at {after} MB");
        // The genuine metadata still works.
        let op = reader
            .begin_read(&good, Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        op.wait_for_completion(super::support::T).await.unwrap();
        println!("INFLATING-OK");
    });
}

/// The `(address, length)` of every descriptor in agent metadata's sections.
fn published_ranges(raw: &[u8]) -> Vec<(u64, u64)> {
    let at = raw.windows(10).position(|w| w == b"MemSection").unwrap() + 11;
    let mut r = &raw[at..];
    let mut entry = |tag: &[u8]| -> Vec<u8> {
        assert!(r.starts_with(tag), "{:?}", &r[..tag.len().min(r.len())]);
        r = &r[tag.len()..];
        let n = u64::from_le_bytes(r[..8].try_into().unwrap()) as usize;
        let v = r[8..8 + n].to_vec();
        r = &r[8 + n + 1..];
        v
    };
    let u = |v: &[u8]| u64::from_le_bytes(v[..8].try_into().unwrap());
    let mut out = Vec::new();
    for _ in 0..u(&entry(b"nixlSecElms")) {
        entry(b"bknd");
        entry(b"nixlDList");
        entry(b"t");
        for _ in 0..u(&entry(b"n")) {
            let d = entry(b"");
            out.push((u(&d[..8]), u(&d[8..16])));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_published_metadata_reaches_only_the_operations_memory() {
    let owner = Connector::new().unwrap();
    let mut buf = nixl_connect::HostBuffer::new(1 << 20).unwrap();
    buf.fill(1);
    // The whole buffer is exposed (and registered) by one operation...
    let whole = owner.create_readable(Descriptor::from(&buf)).await.unwrap();
    // ...then a part of it by another: its metadata must not reach the rest.
    let part = owner
        .create_readable(buf.part(4096..8192).unwrap())
        .await
        .unwrap();
    let ranges = published_ranges(&unpack(&part.metadata().nixl_metadata));
    let d = &part.metadata().descriptors[0];
    assert_eq!(
        ranges,
        vec![(d.ptr, 4096)],
        "the part's metadata publishes only the part"
    );
    let all = published_ranges(&unpack(&whole.metadata().nixl_metadata));
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].1, 1 << 20);
}
