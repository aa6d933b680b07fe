use std::io::{Read, Write};
use std::time::Instant;

use axum::routing::{get, post};

use super::*;

/// `GET /health` over a fresh connection: the whole answer (empty when it was closed).
fn health(port: u16) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Clients that send a request's headers and then trickle nothing of its body (a slow POST)
/// hold every place for as long as they like under a header deadline alone; the total
/// closes them, and the endpoint answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_slow_bodies_hold_no_place_past_the_total() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = Router::new().route("/health", get(|| async { "ok\n" })).route(
        "/reply",
        post(|b: axum::body::Bytes| async move { b.len().to_string() }),
    );
    let limits = Limits {
        connections: 2,
        header: Duration::from_secs(1),
        // Far above a loaded machine's stalls: the probe below must meet both places held.
        total: Duration::from_secs(3),
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app, rx, "test", limits));
    let slow: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"POST /reply HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
                .unwrap();
            s
        })
        .collect();
    // The listener takes connections in the order they came: the slow ones hold both places
    // before this probe is accepted.
    let full = tokio::task::spawn_blocking(move || health(port)).await.unwrap();
    assert!(!full.ends_with("ok\n"), "both places are held: {full:?}");
    // Past the total (and its grace), the slow ones are closed and the endpoint answers.
    let t0 = Instant::now();
    let mut answer = String::new();
    while t0.elapsed() < Duration::from_secs(15) && !answer.ends_with("\r\n\r\nok\n") {
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = tokio::task::spawn_blocking(move || health(port)).await.unwrap();
    }
    assert!(answer.ends_with("\r\n\r\nok\n"), "{answer:?}");
    for mut s in slow {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf); // closed: EOF (after any answer), not a timeout
    }
    let _ = tx.send(());
}
