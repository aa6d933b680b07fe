//! What Dynamo's frontend does in `lib/llm/src/preprocessor/media/rdma.rs` (decode an image into
//! memory, publish a descriptor a worker reads over NIXL), on nixl-connect: the memory is exposed
//! as a readable and stays so until this program's stdin closes; any number of readers may read
//! it, each with a notification key of its own (their notifications are drained by the engine).
//!
//! In Dynamo's media model whoever holds the descriptor reads, with a key the publisher never saw,
//! so the publisher serves over NIXL only (`PathPolicy::Nixl`: no same-host listener). The
//! same-host path serves an operation only to a reader that proves the operation's own key.
//!
//! Prints one JSON line in the shape Dynamo's workers take: `nixl_metadata` ("b64:" + base64 of
//! the zlib-compressed NIXL agent metadata), `nixl_descriptor` (`addr`, `size`, `mem_type`,
//! `device_id`), `shape` (height, width, channels) and `dtype`, as read by
//! `dynamo.common.utils.media_nixl.read_decoded_media_via_nixl`, unmodified.
//!
//! Run: `cargo run --example media_rdma -- picture.png`

use std::error::Error;
use std::io::{BufReader, Read};

use nixl_connect::{Connector, Descriptor, HostBuffer, PathPolicy};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let path = std::env::args().nth(1).ok_or("usage: media_rdma IMAGE.png")?;
    // Decode to 8-bit samples (palettes expanded), as the frontend's decoder does.
    let mut decoder = png::Decoder::new(BufReader::new(std::fs::File::open(&path)?));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info()?;
    let mut pixels = HostBuffer::new(reader.output_buffer_size().ok_or("image too large")?)?;
    let frame = reader.next_frame(&mut pixels)?;
    let shape = [
        frame.height as usize,
        frame.width as usize,
        frame.color_type.samples(),
    ];

    let conn = Connector::builder().path(PathPolicy::Nixl).build()?;
    let op = conn.create_readable(Descriptor::from(pixels)).await?;
    let (md, d) = (op.metadata(), &op.metadata().descriptors[0]);
    let published = serde_json::json!({
        "nixl_metadata": md.nixl_metadata,
        "nixl_descriptor": {"addr": d.ptr, "size": d.size, "mem_type": "Dram", "device_id": 0},
        "shape": shape,
        "dtype": "uint8",
    });
    println!("{published}");

    // Serve reads until stdin closes (the peer says it is done, or goes away).
    tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await??;
    drop(op);
    Ok(())
}
