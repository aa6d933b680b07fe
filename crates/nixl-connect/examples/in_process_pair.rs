//! Rust's cost per operation with both sides in one process: the anchor for the Python module's
//! (`scripts/bench_python_ops.py` runs this beside it). Two connectors, 4 KiB `HostBuffer`s
//! reused, every iteration a new readable and a new read, both awaited (`tokio::join!`) and
//! dropped: Dynamo's `plain` pattern without Python. Prints one JSON line of medians (µs) over
//! the iterations after the first 10, which connect.
//!
//! With `fresh`, the readable's memory is a new `Vec` every iteration (allocated, filled, freed
//! after the operation), as Dynamo's multimodal caller wraps every payload in a new tensor: each
//! readable then registers its memory with NIXL and makes its metadata, and the reader decodes
//! metadata it has not seen. That is the Rust floor for the `dynamo` pattern of
//! `scripts/bench_python_ops.py`.
//!
//! Run: `cargo run --release --example in_process_pair [ITERS] [fresh]` (default 2,000).

use std::time::Instant;

use nixl_connect::{Connector, Descriptor, HostBuffer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> nixl_connect::Result<()> {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
        .max(11);
    let fresh = std::env::args().nth(2).as_deref() == Some("fresh");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let (a, b) = (Connector::new()?, Connector::new()?);
        let mut src = HostBuffer::from_slice(&[7u8; 4096])?;
        let mut dst = HostBuffer::new(4096)?;
        let (mut expose, mut begin, mut wait, mut total) = (vec![], vec![], vec![], vec![]);
        for _ in 0..iters {
            let t0 = Instant::now();
            let mut payload = fresh.then(|| vec![7u8; 4096]);
            let exposed = match payload.as_deref_mut() {
                Some(p) => Descriptor::from(p),
                None => Descriptor::from(&mut src),
            };
            let readable = a.create_readable(exposed).await?;
            let t1 = Instant::now();
            let read = b.begin_read(readable.metadata(), Descriptor::from(&mut dst)).await?;
            let t2 = Instant::now();
            let (r, w) = tokio::join!(read.wait_for_completion(None), readable.wait_for_completion(None));
            r?;
            w?;
            let t3 = Instant::now();
            drop(read);
            drop(readable);
            drop(payload);
            let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
            expose.push(us(t0, t1));
            begin.push(us(t1, t2));
            wait.push(us(t2, t3));
            total.push(us(t0, Instant::now()));
        }
        assert_eq!(&dst[..], &src[..], "the bytes arrived");
        let m = |v: &mut Vec<f64>| median(v.split_off(10));
        println!(
            "{{\"create_readable_us\": {:.1}, \"begin_read_us\": {:.1}, \"wait_both_us\": {:.1}, \"median_us\": {:.1}}}",
            m(&mut expose),
            m(&mut begin),
            m(&mut wait),
            m(&mut total)
        );
        Ok(())
    })
}
