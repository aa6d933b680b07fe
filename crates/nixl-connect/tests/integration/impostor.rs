//! An impostor on the same-host socket: a same-user process (here a thread) that binds the
//! socket name of a connector that does not listen (a NIXL-only connector, a Python peer, a name
//! `bind_unique` gave up on), ready to answer the handshake and forge the rest. Such a peer's
//! agent name advertises no same-host endpoint, so it is never connected to.

use std::io::Write;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_connect::{Connector, Descriptor, PathPolicy, TransferPath};

use super::support::{pattern, read_frame, T};

fn send(s: &mut impl Write, body: &[u8]) {
    let _ = s.write_all(&(body.len() as u32).to_le_bytes());
    let _ = s.write_all(body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impostor_learns_nothing_and_forges_nothing() {
    // The victim exposes over NIXL only: it does not listen on its same-host name.
    let owner = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
    let want = pattern(1 << 20, 21);
    let r = owner
        .create_readable(Descriptor::from(want.clone()))
        .await
        .unwrap();
    let md = r.metadata().clone();
    let name = format!("nixl-connect.v1/{}", owner.name());
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
        .expect("the impostor binds the victim's socket name");

    // The impostor: records every frame, answers Hello with a forged proof, grants everything,
    // then claims completion.
    let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let log = log.clone();
            std::thread::spawn(move || {
                while let Some(f) = read_frame(&mut s) {
                    log.lock().unwrap().push(f.clone());
                    match f[0] {
                        1 => {
                            let mut w = vec![2u8, 1];
                            w.extend_from_slice(&[0x42; 32]); // a proof it cannot compute
                            send(&mut s, &w);
                        }
                        4 => {
                            let mut g = vec![5u8];
                            g.extend_from_slice(&f[1..13]); // slot, gen
                            send(&mut s, &g);
                            let mut d = vec![8u8];
                            d.extend_from_slice(&f[1..13]);
                            d.extend_from_slice(&[1, 0, 0]);
                            send(&mut s, &d);
                        }
                        _ => {}
                    }
                }
            });
        }
    });

    let reader = Connector::new().unwrap();
    let op = reader
        .begin_read(&md, Descriptor::from(vec![0u8; want.len()]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert_eq!(
        op.path(),
        Some(TransferPath::Nixl),
        "the read went around the impostor"
    );
    let got = op.into_descriptors().unwrap();
    assert_eq!(got[0].as_slice().unwrap(), &want[..], "the bytes are the owner's");
    r.wait_for_completion(T).await.unwrap();

    tokio::time::sleep(Duration::from_millis(50)).await;
    let frames = seen.lock().unwrap().clone();
    // Round 4: the victim advertises no same-host endpoint (as a Python Dynamo peer does not),
    // so the reader never connects to its name: the impostor hears nothing at all, not even a
    // key's hash. (An advertising owner's squatter: hostile.rs.)
    assert!(
        frames.is_empty(),
        "the reader connected to a name that advertises nothing: {} frames",
        frames.len()
    );
    let s = reader.stats().await.unwrap();
    assert_eq!(s.local_refused_peers, 0, "{s:?}");
}
