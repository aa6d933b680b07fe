use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Feeds `src` through `n` lanes (one thread per lane each side) into a zeroed buffer of the same
/// size, laid out as `pieces` says on both sides; returns the destination.
fn through(src: &[u8], n: usize, pieces: impl Fn(usize) -> Vec<(usize, usize)>) -> Vec<u8> {
    let mut lanes = Lanes::new(n).unwrap();
    let ends = lanes.take_read_ends();
    let mut dst = vec![0u8; src.len()];
    let ended = AtomicBool::new(false);
    let wake = Wake::new().unwrap();
    let (s, d) = (src.as_ptr() as usize, dst.as_mut_ptr() as usize);
    let (total, n) = (src.len(), lanes.len());
    std::thread::scope(|sc| {
        let mut hs = Vec::new();
        for k in 0..n {
            let (a, b) = span(total, n, k);
            let (from, to) = (cut(&pieces(s), a, b), cut(&pieces(d), a, b));
            let (w, r) = (&lanes.w.0[k], &ends.0[k]);
            assert!(is_read_end(r));
            let (ended, wake) = (&ended, &wake);
            hs.push(sc.spawn(move || feed(w, &from, ended, wake)));
            hs.push(sc.spawn(move || fill(r, &to, &AtomicBool::new(false), wake)));
        }
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
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

/// Only an anonymous pipe's read end, opened for reading only, is taken: not its write end, a
/// socket, a file, a memfd, nor a named FIFO (which lives on a file system a peer may control).
#[test]
fn pipe_read_end_check_refuses_other_descriptors() {
    let mut l = Lanes::new(1).unwrap();
    let ends = l.take_read_ends();
    assert!(is_read_end(&ends.0[0]));
    assert!(!is_read_end(&l.w.0[0].try_clone().unwrap()), "a write end");
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(!is_read_end(&OwnedFd::from(a)), "a socket");
    let f = std::fs::File::open("/proc/self/stat").unwrap();
    assert!(!is_read_end(&OwnedFd::from(f)), "a file");
    // SAFETY: memfd_create with a static name; the descriptor is owned at once.
    let m = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
    // SAFETY: fresh.
    assert!(!is_read_end(&unsafe { OwnedFd::from_raw_fd(m) }), "a memfd");
    let dir = std::env::temp_dir().join(format!("nxc-fifo-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo and open with a live NUL-terminated path; the descriptor is owned at once.
    let fifo = unsafe {
        assert_eq!(libc::mkfifo(path.as_ptr(), 0o600), 0);
        OwnedFd::from_raw_fd(libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK))
    };
    assert!(!is_read_end(&fifo), "a named FIFO");
    let _ = std::fs::remove_file(&dir);
}

/// A reader whose source never feeds waits in `poll`, and its cancellation wakes it at once: it
/// reports that nothing moved. So does one whose peer cleared `O_NONBLOCK` on the read end's
/// shared open file (the reads are `RWF_NOWAIT`, never a wait in the kernel).
#[test]
fn pipe_fill_cancelled_while_waiting_ends_not_started() {
    for clear_nonblock in [false, true] {
        let mut l = Lanes::new(1).unwrap();
        let ends = l.take_read_ends();
        let r = &ends.0[0];
        if clear_nonblock {
            // SAFETY: fcntl on a descriptor this test owns, as the peer would on its own.
            unsafe { libc::fcntl(r.as_raw_fd(), libc::F_SETFL, 0) };
        }
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
        assert_eq!(fill(r, &p, &cancel, &wake), Err(CopyError::NotStarted));
        t.join().unwrap();
    }
}

/// What a pipe holds is a copy of the source taken while the operation was live, never a reference
/// to its pages: the source's owner overwrites its memory once the feed is done, and the reader
/// still reads what was granted (round 4's rule: nothing of the memory's later contents reaches a
/// peer, whatever it does with its read end).
#[test]
fn pipe_reader_gets_a_copy_not_the_source_pages() {
    let mut src = pattern(256 << 10, 5);
    let want = src.clone();
    let mut l = Lanes::new(1).unwrap();
    let ends = l.take_read_ends();
    let (ended, wake) = (AtomicBool::new(false), Wake::new().unwrap());
    feed(&l.w.0[0], &[(src.as_ptr() as usize, src.len())], &ended, &wake).unwrap();
    src.fill(0xEE);
    let mut dst = vec![0u8; want.len()];
    fill(
        &ends.0[0],
        &[(dst.as_mut_ptr() as usize, dst.len())],
        &AtomicBool::new(false),
        &wake,
    )
    .unwrap();
    assert!(dst == want, "the reader saw the source's later contents");
}

/// A feed whose reader stopped reading (its pipe full) ends at once when its operation ends; one
/// whose reader closed its end does not raise `SIGPIPE` (this side keeps a reader).
#[test]
fn pipe_feed_ends_with_its_operation_and_never_raises_sigpipe() {
    let src = pattern(8 << 20, 9);
    let mut l = Lanes::new(1).unwrap();
    let ends = l.take_read_ends();
    drop(ends); // the reader went away
    let ended = AtomicBool::new(false);
    let wake = Wake::new().unwrap();
    let r = std::thread::scope(|sc| {
        let h = sc.spawn(|| feed(&l.w.0[0], &[(src.as_ptr() as usize, src.len())], &ended, &wake));
        std::thread::sleep(std::time::Duration::from_millis(50));
        ended.store(true, Ordering::Release);
        wake.wake();
        h.join().unwrap()
    });
    assert_eq!(r, Err(CopyError::Revoked));
}
