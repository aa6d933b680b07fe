use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Feeds `src` through `n` lanes into a zeroed buffer of the same size (one thread per lane
/// reading, one feeding); the destination must equal the source.
fn through(src: &[u8], n: usize, pieces: impl Fn(usize) -> Vec<(usize, usize)>) -> Vec<u8> {
    let lanes = Arc::new(lanes(n).unwrap());
    let mut dst = vec![0u8; src.len()];
    let ended = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Wake::new().unwrap());
    let (s, d) = (src.as_ptr() as usize, dst.as_mut_ptr() as usize);
    let total = src.len();
    std::thread::scope(|sc| {
        let feeder = {
            let (lanes, ended, wake) = (lanes.clone(), ended.clone(), wake.clone());
            let p = pieces(s);
            sc.spawn(move || feed(&lanes, &p, &ended, &wake))
        };
        let readers: Vec<_> = (0..lanes.len())
            .map(|k| {
                let r = lanes[k].read_end().unwrap();
                assert!(is_read_end(&r));
                let (a, b) = span(total, lanes.len(), k);
                let mine = cut(&pieces(d), a, b);
                let wake = wake.clone();
                sc.spawn(move || fill(&r, &mine, &AtomicBool::new(false), &wake))
            })
            .collect();
        for r in readers {
            r.join().unwrap().unwrap();
        }
        feeder.join().unwrap().unwrap();
    });
    ended.store(true, Ordering::Release);
    drain(&lanes);
    dst
}

#[test]
fn pipe_lanes_carry_every_byte_in_order() {
    for (len, n) in [(1usize, 1usize), (4097, 2), (3 << 20, 3), (9 << 20, 4)] {
        let src = pattern(len, len as u8);
        assert_eq!(
            through(&src, n, |base| vec![(base, len)]),
            src,
            "{len} bytes, {n} lanes"
        );
    }
}

#[test]
fn pipe_lanes_carry_scattered_pieces() {
    let len = 5 << 20;
    let src = pattern(len, 7);
    // Five pieces of uneven sizes, in order: the stream is their concatenation on both sides.
    let cuts = [0usize, 1, 4096 * 3 + 5, 2 << 20, (2 << 20) + 17, len];
    let got = through(&src, 3, |base| {
        cuts.windows(2).map(|w| (base + w[0], w[1] - w[0])).collect()
    });
    assert_eq!(got, src);
}

#[test]
fn pipe_span_and_cut_cover_the_stream_once() {
    for total in [0usize, 1, 7, 1 << 20, (1 << 20) + 3] {
        for n in 1..=MAX_LANES {
            let mut at = 0;
            for k in 0..n {
                let (a, b) = span(total, n, k);
                assert_eq!(a, at);
                at = b;
            }
            assert_eq!(at, total);
        }
    }
    let pieces = [(100usize, 10usize), (1000, 5), (5000, 20)];
    assert_eq!(cut(&pieces, 8, 17), vec![(108, 2), (1000, 5), (5000, 2)]);
    assert_eq!(cut(&pieces, 0, 0), vec![]);
    assert_eq!(cut(&pieces, 34, 35), vec![(5019, 1)]);
}

#[test]
fn pipe_read_end_check_refuses_other_descriptors() {
    let l = lanes(1).unwrap();
    assert!(is_read_end(&l[0].read_end().unwrap()));
    assert!(!is_read_end(&l[0].w.try_clone().unwrap()), "a write end");
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(!is_read_end(&OwnedFd::from(a)), "a socket");
    let f = std::fs::File::open("/proc/self/stat").unwrap();
    assert!(!is_read_end(&OwnedFd::from(f)), "a file");
    // SAFETY: memfd_create with a static name; the descriptor is owned at once.
    let m = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
    // SAFETY: fresh.
    assert!(!is_read_end(&unsafe { OwnedFd::from_raw_fd(m) }), "a memfd");
}

/// A reader whose source never feeds waits in `poll`, and its cancellation wakes it at once: it
/// reports that nothing moved.
#[test]
fn pipe_fill_cancelled_while_waiting_ends_not_started() {
    let l = lanes(1).unwrap();
    let r = l[0].read_end().unwrap();
    assert!(is_read_end(&r));
    let mut dst = vec![0u8; 1 << 16];
    let p = vec![(dst.as_mut_ptr() as usize, dst.len())];
    let cancel = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Wake::new().unwrap());
    let (c2, w2) = (cancel.clone(), wake.clone());
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        c2.store(true, Ordering::Release);
        w2.wake();
    });
    assert_eq!(fill(&r, &p, &cancel, &wake), Err(CopyError::NotStarted));
    t.join().unwrap();
}

/// The source ends the operation after feeding part of the stream and drains: the reader finds
/// no more of the source's pages in the pipe (it reads only what it took before), and the end of
/// the stream (the source closed its ends) reports the copy revoked.
#[test]
fn pipe_drain_leaves_no_page_of_the_source_for_the_reader() {
    let src = pattern(4 << 20, 3);
    let l = lanes(1).unwrap();
    let r = l[0].read_end().unwrap();
    assert!(is_read_end(&r));
    let ended = AtomicBool::new(false);
    let wake = Wake::new().unwrap();
    // Fill the pipe (it takes at most PIPE_BYTES), then end before the rest is fed.
    let fed = std::thread::scope(|sc| {
        let h = sc.spawn(|| feed(&l, &[(src.as_ptr() as usize, src.len())], &ended, &wake));
        std::thread::sleep(std::time::Duration::from_millis(50));
        ended.store(true, Ordering::Release);
        wake.wake();
        h.join().unwrap()
    });
    assert_eq!(fed, Err(CopyError::Revoked));
    drain(&l);
    drop(l);
    let mut b = [0u8; 64];
    // SAFETY: reads into a live local buffer of its length.
    let n = unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) };
    assert_eq!(
        n, 0,
        "the pipe is empty and closed: nothing of the source is left"
    );
}
