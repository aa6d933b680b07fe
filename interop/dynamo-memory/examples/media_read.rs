//! Reads what Dynamo's Rust media path publishes, across two processes: the mirror of
//! nixl-connect's `examples/media_rdma.rs` (which Dynamo's Python reader reads).
//!
//! `media_read publish H W` is the publisher, as Dynamo's frontend (`dynamo-llm`'s
//! `preprocessor/media`) does it with `dynamo-memory`: an H x W RGB image in `SystemStorage`,
//! registered with a `NixlAgent` (UCX), its `RdmaMediaDataDescriptor` printed as one JSON line;
//! it serves until whoever reads its stdout closes it (the reader exits). `media_read` reads one such line from stdin, reads the image
//! with a nixl-connect connector over NIXL, and prints its shape, size and a checksum (the
//! publisher prints the same checksum to stderr).
//!
//! Run: `cargo run --example media_read -- publish 480 640 | cargo run --example media_read`
//! (the reader exits when it has read; the publisher sees its stdout closed and exits too).

use std::error::Error;
use std::io::{BufRead, Write};

use dynamo_memory::nixl::{register_with_nixl, NixlAgent, RegisteredView};
use dynamo_memory::SystemStorage;
use nixl_connect::{Connector, RdmaMetadata};
use nixl_connect_dynamo_memory::{descriptor, media};

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn publish(h: usize, w: usize) -> Result<(), Box<dyn Error>> {
    // nixl-connect finds and loads NIXL (NIXL_CONNECT_LIB, a venv, ...) before nixl-sys is called.
    nixl_connect::nixl_library::load()?;
    let agent = NixlAgent::with_backends(&format!("media-loader-{}", std::process::id()), &["UCX"])?;
    let data: Vec<u8> = (0..h * w * 3).map(|i| (i * 7 % 256) as u8).collect();
    let mut storage = SystemStorage::new(data.len())?;
    // SAFETY: the storage is data.len() bytes, owned here, with no other reference.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), storage.as_mut_ptr(), data.len()) };
    let registered =
        register_with_nixl(storage, agent.raw_agent(), None).map_err(|_| "NIXL registration failed")?;
    let published = serde_json::json!({
        "nixl_metadata": RdmaMetadata::encode_agent_metadata(&agent.raw_agent().get_local_md()?),
        "nixl_descriptor": serde_json::to_value(registered.descriptor())?,
        "shape": [h, w, 3],
        "dtype": "UINT8",
        "metadata": null,
    });
    println!("{published}");
    std::io::stdout().flush()?;
    eprintln!("published {h}x{w}x3, checksum {:016x}", checksum(&data));
    // Serve until the reader closes the pipe: poll reports an error or hang-up on a pipe's
    // writing end once its reading end is gone.
    let mut fd = libc::pollfd {
        fd: 1,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for the whole call.
    while unsafe { libc::poll(&mut fd, 1, -1) } < 0
        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
    {}
    drop(registered);
    Ok(())
}

async fn read() -> Result<(), Box<dyn Error>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let published: serde_json::Value = serde_json::from_str(&line)?;
    let md = media::metadata(&published, &format!("media-read-{}", std::process::id()))?;
    let size = md.descriptors[0].size as usize;
    let conn = Connector::new()?;
    let op = conn
        .begin_read(&md, vec![descriptor(SystemStorage::new(size)?)])
        .await?;
    op.wait_for_completion(Some(std::time::Duration::from_secs(60)))
        .await?;
    let got = op.into_descriptors().map_err(|_| "the read has not ended")?;
    let bytes = got[0].as_slice().ok_or("not host memory")?;
    println!(
        "read shape {} ({size} bytes), checksum {:016x}",
        published["shape"],
        checksum(bytes)
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("publish") => {
            let h = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(480);
            let w = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(640);
            publish(h, w)
        }
        _ => read().await,
    }
}
