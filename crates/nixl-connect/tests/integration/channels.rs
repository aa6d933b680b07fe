//! Metadata channels: the embedded HTTP server and NATS request/reply against a real
//! `nats-server` (Debian's package, installed by `bash scripts/setup.sh --nats`), started here on a
//! free loopback port. No mock stands in for either.

use std::time::{Duration, Instant};

#[cfg(feature = "http")]
use nixl_connect::channel::http::{self, HttpChannel};
use nixl_connect::{Connector, Descriptor, Error, RdmaMetadata};

use super::support::free_port;

const T: Duration = Duration::from_secs(30);

async fn readable_and_reader(a: &Connector) -> (nixl_connect::ReadableOperation<'static>, RdmaMetadata) {
    let r = a
        .create_readable(Descriptor::from(
            (0..4096u32).map(|i| i as u8).collect::<Vec<u8>>(),
        ))
        .await
        .unwrap();
    let md = r.metadata().clone();
    (r, md)
}

async fn read_it(b: &Connector, md: &RdmaMetadata) {
    let op = b.begin_read(md, Descriptor::from(vec![0u8; 4096])).await.unwrap();
    op.wait_for_completion(Some(T)).await.unwrap();
    let got = op.results()[0].as_slice().unwrap().to_vec();
    assert_eq!(got, (0..4096u32).map(|i| i as u8).collect::<Vec<u8>>());
}

#[cfg(feature = "http")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_http_publish_fetch_and_unpublish() {
    let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
    let ch = HttpChannel::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let (r, md) = readable_and_reader(&a).await;
    let extra = serde_json::json!({"checksum": "abc", "name": "x.bin"});
    let publication = ch.publish_with(&md, &extra);
    assert!(
        publication.url().starts_with("http://127.0.0.1:"),
        "{}",
        publication.url()
    );
    assert_eq!(ch.len(), 1);
    let fetched = http::fetch(publication.url(), T).await.unwrap();
    assert_eq!(fetched, md, "the plain GET returns exactly the RdmaMetadata");
    assert_eq!(http::fetch_extra(publication.url(), T).await.unwrap(), extra);
    read_it(&b, &fetched).await;
    r.wait_for_completion(Some(T)).await.unwrap();
    let url = publication.url().to_string();
    drop(publication);
    assert!(ch.is_empty());
    let e = http::fetch(&url, T).await.unwrap_err();
    assert!(matches!(e, Error::NotPublished { .. }), "{e}");
    // Paths are unguessable: a made-up id is not found either.
    let guess = format!("{}/nixl/{}", url.rsplit_once("/nixl/").unwrap().0, "0".repeat(32));
    assert!(matches!(
        http::fetch(&guess, T).await,
        Err(Error::NotPublished { .. })
    ));
}

#[cfg(feature = "http")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_http_global_serves_many_operations() {
    let a = Connector::new().unwrap();
    let ch = HttpChannel::global().await.unwrap();
    let mut ops = Vec::new();
    for _ in 0..20 {
        let (r, md) = readable_and_reader(&a).await;
        let p = ch.publish(&md);
        ops.push((r, md, p));
    }
    for (_, md, p) in &ops {
        assert_eq!(&http::fetch(p.url(), T).await.unwrap(), md);
    }
    let again = HttpChannel::global().await.unwrap();
    assert_eq!(again.local_addr(), ch.local_addr(), "one listener per process");
}

#[cfg(feature = "http")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_http_fetch_is_bounded() {
    // A server that accepts and never answers: the fetch times out instead of hanging.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let t0 = Instant::now();
    let e = http::fetch(&format!("http://{addr}/nixl/x"), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TimedOut { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    hold.abort();
    // Nobody listening: a channel error naming the URL.
    let closed = free_port();
    let e = http::fetch(&format!("http://127.0.0.1:{closed}/nixl/x"), T)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Channel(m) if m.message().contains("cannot reach")),
        "{e}"
    );
    let e = http::fetch("ftp://example/x", T).await.unwrap_err();
    assert!(matches!(e, Error::Channel(_)), "{e}");
}

// ---------------------------------------------------------------- NATS

#[cfg(feature = "nats")]
mod nats {
    use std::net::SocketAddr;
    use std::process::{Child, Command, Stdio};

    use super::*;
    use nixl_connect::channel::nats::NatsChannel;

    /// A real nats-server on a free loopback port, killed on drop.
    struct NatsServer {
        child: Child,
        url: String,
    }

    impl NatsServer {
        fn start() -> Self {
            Self::start_on(free_port())
        }

        /// Kills the server and starts another on the same port (a restarted pod).
        fn restart(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let port: u16 = self.url.rsplit(':').next().unwrap().parse().unwrap();
            let again = Self::start_on(port);
            let old = std::mem::replace(self, again);
            std::mem::forget(old); // already reaped
        }

        fn start_on(port: u16) -> Self {
            let child = Command::new("nats-server")
                .args(["-a", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("nats-server is not installed ({e}): run `bash scripts/setup.sh --nats`")
                });
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let t0 = Instant::now();
            while std::net::TcpStream::connect(addr).is_err() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "nats-server did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            NatsServer {
                child,
                url: format!("nats://{addr}"),
            }
        }
    }

    impl Drop for NatsServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn channel_nats_publish_fetch_and_unpublish() {
        let server = NatsServer::start();
        let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
        let publisher = NatsChannel::connect(&server.url, T).await.unwrap();
        let fetcher = NatsChannel::connect(&server.url, T).await.unwrap();
        let (r, md) = readable_and_reader(&a).await;
        let publication = publisher.publish(&md).await.unwrap();
        let fetched = fetcher.fetch(publication.subject(), T).await.unwrap();
        assert_eq!(fetched, md);
        read_it(&b, &fetched).await;
        r.wait_for_completion(Some(T)).await.unwrap();
        let subject = publication.subject().to_string();
        drop(publication);
        let e = fetcher.fetch(&subject, Duration::from_secs(2)).await.unwrap_err();
        assert!(
            matches!(e, Error::NotPublished { .. } | Error::TimedOut { .. }),
            "{e}"
        );
    }

    /// nats-server killed and started again on its address under a running publication and a
    /// reader: both clients reconnect by themselves, the publisher's subscription is made again
    /// on the new server, the reader's next fetch is answered, and each channel reports the gap
    /// (`NatsChannel::outages`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn channel_nats_restarted_server_publications_answer_again() {
        let mut server = NatsServer::start();
        let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
        let publisher = NatsChannel::connect(&server.url, T).await.unwrap();
        let fetcher = NatsChannel::connect(&server.url, T).await.unwrap();
        let (r, md) = readable_and_reader(&a).await;
        let publication = publisher.publish(&md).await.unwrap();
        assert_eq!(fetcher.fetch(publication.subject(), T).await.unwrap(), md);
        for round in 0..2 {
            server.restart();
            let t0 = Instant::now();
            let fetched = loop {
                match fetcher.fetch(publication.subject(), Duration::from_secs(1)).await {
                    Ok(m) => break m,
                    Err(e) => assert!(
                        t0.elapsed() < Duration::from_secs(20),
                        "round {round}: not answered {:?} after the restart: {e}",
                        t0.elapsed()
                    ),
                }
            };
            println!("round {round}: answered again after {:?}", t0.elapsed());
            assert_eq!(fetched, md);
            // The reconnection is reported once the client is back (its callback runs on it).
            let t0 = Instant::now();
            while publisher.outages().len() < round + 1 || fetcher.outages().len() < round + 1 {
                assert!(t0.elapsed() < T, "round {round}: outages not reported");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let o = publisher.outages().last().cloned().unwrap();
            println!("round {round}: publisher's outage {o:?}");
            assert!(
                !o.cause.is_empty() && o.lasted < Duration::from_secs(20) && !o.republished,
                "{o:?}"
            );
        }
        read_it(&b, &fetcher.fetch(publication.subject(), T).await.unwrap()).await;
        r.wait_for_completion(Some(T)).await.unwrap();
    }

    /// The race CI met: a peer's fetch that starts the moment `publish` returns, on another
    /// connection, must find the subscription (a client flush alone does not wait for the server).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn channel_nats_fetch_right_after_publish_is_answered() {
        let server = NatsServer::start();
        let a = Connector::new().unwrap();
        let publisher = NatsChannel::connect(&server.url, T).await.unwrap();
        let fetcher = NatsChannel::connect(&server.url, T).await.unwrap();
        let (_r, md) = readable_and_reader(&a).await;
        for i in 0..500 {
            let publication = publisher.publish(&md).await.unwrap();
            let fetched = fetcher
                .fetch(publication.subject(), T)
                .await
                .unwrap_or_else(|e| panic!("publication {i}: {e}"));
            assert_eq!(fetched, md);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn channel_nats_server_gone_is_an_error_not_a_hang() {
        let mut server = NatsServer::start();
        let a = Connector::new().unwrap();
        let publisher = NatsChannel::connect(&server.url, T).await.unwrap();
        let fetcher = NatsChannel::connect(&server.url, T).await.unwrap();
        let (_r, md) = readable_and_reader(&a).await;
        let publication = publisher.publish(&md).await.unwrap();
        let _ = server.child.kill();
        let _ = server.child.wait();
        let t0 = Instant::now();
        let e = fetcher
            .fetch(publication.subject(), Duration::from_secs(3))
            .await
            .unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "bounded: {e} after {:?}",
            t0.elapsed()
        );
        assert!(
            matches!(
                e,
                Error::TimedOut { .. } | Error::Channel(_) | Error::NotPublished { .. }
            ),
            "{e}"
        );
        // Connecting to a server that is not there fails within the timeout.
        let t0 = Instant::now();
        let e = NatsChannel::connect(&server.url, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(10), "{e}");
    }
}
