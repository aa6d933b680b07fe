//! What each hop of a same-host read costs on this machine, measured one by one (medians), so
//! the end-to-end figure of `nixl-connect bench --path local` can be read as a sum.
//!
//! A 4 KiB read on the same-host path crosses, on its critical path: the caller's task to the
//! engine thread (an eventfd wake), one socket round trip to the owner (`Req` -> `Grant`, each
//! side's engine woken by epoll), the engine to a copy-pool thread and back (two condvar
//! wake-ups: copies of a peer's memory never run on the engine thread), the copy itself
//! (`process_vm_readv`), frame MACs (HMAC-SHA256 under the operation's key: four per read, two on
//! each side), and the engine waking the caller's task. The passive side completes when the
//! reader's `Done` arrives: one more one-way socket hop.
//!
//! Run: `cargo run --release --example same_host_hops` (prints a table; `--json` for JSON lines).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use hmac::{KeyInit, Mac};

const N: usize = 20_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..n / 10 {
        f();
    }
    median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    )
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let mut rows: Vec<(&str, f64, &str)> = Vec::new();

    // A second process: echoes 64-byte frames on a socket pair and owns 4 KiB to be read.
    let (mut ours, mut theirs) = UnixStream::pair().unwrap();
    let page = vec![0x5au8; 4096];
    // SAFETY: fork while this program is single-threaded; the child only reads and writes its
    // socket, then exits.
    #[allow(unsafe_code)]
    let child = unsafe { libc::fork() };
    if child == 0 {
        drop(ours);
        let mut b = [0u8; 64];
        // Blocking echoes first, then (after a frame of 0xff) echoes polled without sleeping, as
        // a hot engine does.
        while theirs.read_exact(&mut b).is_ok() {
            if b[0] == 0xff {
                theirs.set_nonblocking(true).unwrap();
                loop {
                    match theirs.read(&mut b) {
                        Ok(0) => break,
                        Ok(_) => {
                            theirs.set_nonblocking(false).unwrap();
                            theirs.write_all(&b).unwrap();
                            theirs.set_nonblocking(true).unwrap();
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                        Err(_) => break,
                    }
                }
                break;
            }
            if theirs.write_all(&b).is_err() {
                break;
            }
        }
        // SAFETY: ends the child without running the parent's destructors.
        #[allow(unsafe_code)]
        unsafe {
            libc::_exit(0)
        };
    }
    drop(theirs);
    let mut b = [0u8; 64];
    rows.push((
        "socket round trip, two processes, both asleep between frames",
        time(N, || {
            ours.write_all(&b).unwrap();
            ours.read_exact(&mut b).unwrap();
        }),
        "1 (Req -> Grant) when the engines sleep; + 1 one-way Done",
    ));
    b[0] = 0xff;
    ours.write_all(&b).unwrap();
    b[0] = 0;
    ours.set_nonblocking(true).unwrap();
    rows.push((
        "socket round trip, two processes, both polling (hot engines)",
        time(N, || {
            ours.set_nonblocking(false).unwrap();
            ours.write_all(&b).unwrap();
            ours.set_nonblocking(true).unwrap();
            let mut got = 0;
            while got < b.len() {
                match ours.read(&mut b[got..]) {
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                    Err(e) => panic!("{e}"),
                }
            }
        }),
        "1 (Req -> Grant) when the engines spin",
    ));
    ours.set_nonblocking(false).unwrap();

    let mut dst = vec![0u8; 4096];
    rows.push((
        "process_vm_readv, 4 KiB",
        time(N, || {
            let local = libc::iovec {
                iov_base: dst.as_mut_ptr().cast(),
                iov_len: 4096,
            };
            let remote = libc::iovec {
                iov_base: page.as_ptr() as *mut libc::c_void,
                iov_len: 4096,
            };
            // SAFETY: reads 4 KiB of the child's copy of `page` (same address after fork) into
            // `dst`, which this process owns.
            #[allow(unsafe_code)]
            let n = unsafe { libc::process_vm_readv(child, &local, 1, &remote, 1, 0) };
            assert_eq!(n, 4096);
        }),
        "1",
    ));
    drop(ours);
    let mut st = 0;
    // SAFETY: reaps our own child.
    #[allow(unsafe_code)]
    unsafe {
        libc::waitpid(child, &mut st, 0)
    };

    // Two threads handing a job back and forth through a mutex and condvar (engine <-> pool).
    let pair = Arc::new((Mutex::new(0u64), Condvar::new()));
    let p2 = pair.clone();
    let pool = std::thread::spawn(move || {
        let (m, cv) = &*p2;
        let mut g = m.lock().unwrap();
        loop {
            while *g % 2 == 0 {
                g = cv.wait(g).unwrap();
            }
            if *g == u64::MAX {
                return;
            }
            *g += 1;
            cv.notify_all();
        }
    });
    let (m, cv) = &*pair;
    rows.push((
        "thread hand-off and back, the pool thread asleep (engine -> pool -> engine)",
        time(N, || {
            let mut g = m.lock().unwrap();
            *g += 1;
            cv.notify_all();
            while *g % 2 == 1 {
                g = cv.wait(g).unwrap();
            }
        }),
        "1",
    ));
    *m.lock().unwrap() = u64::MAX;
    cv.notify_all();
    pool.join().unwrap();

    // The same hand-off between two threads that spin on an atomic (a pool thread kept hot).
    let flag = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let f2 = flag.clone();
    let spinner = std::thread::spawn(move || loop {
        let v = f2.load(std::sync::atomic::Ordering::Acquire);
        if v == u64::MAX {
            return;
        }
        if v % 2 == 1 {
            f2.store(v + 1, std::sync::atomic::Ordering::Release);
        }
        std::hint::spin_loop();
    });
    rows.push((
        "thread hand-off and back, both threads spinning",
        time(N, || {
            let v = flag.load(std::sync::atomic::Ordering::Acquire);
            flag.store(v + 1, std::sync::atomic::Ordering::Release);
            while flag.load(std::sync::atomic::Ordering::Acquire) == v + 1 {
                std::hint::spin_loop();
            }
        }),
        "1 when the pool spins (it does not: it sleeps on a condvar)",
    ));
    flag.store(u64::MAX, std::sync::atomic::Ordering::Release);
    spinner.join().unwrap();

    // The caller's task waking the engine (eventfd) and being woken back.
    // SAFETY: two fresh eventfds, owned below.
    #[allow(unsafe_code)]
    let (a, z) = unsafe { (libc::eventfd(0, 0), libc::eventfd(0, 0)) };
    let engine = std::thread::spawn(move || {
        let mut v = 0u64;
        loop {
            // SAFETY: 8-byte reads and writes of eventfds this program owns.
            #[allow(unsafe_code)]
            unsafe {
                libc::read(a, (&mut v as *mut u64).cast(), 8);
                if v == 2 {
                    return;
                }
                libc::write(z, (&1u64 as *const u64).cast(), 8);
            }
        }
    });
    rows.push((
        "caller -> engine thread -> caller (eventfd wake-ups)",
        time(N, || {
            let mut v = 0u64;
            // SAFETY: as above.
            #[allow(unsafe_code)]
            unsafe {
                libc::write(a, (&1u64 as *const u64).cast(), 8);
                libc::read(z, (&mut v as *mut u64).cast(), 8);
            }
        }),
        "1",
    ));
    // SAFETY: as above; then the fds are closed once the thread is gone.
    #[allow(unsafe_code)]
    unsafe {
        libc::write(a, (&2u64 as *const u64).cast(), 8);
    }
    engine.join().unwrap();
    // SAFETY: closes the two eventfds made above.
    #[allow(unsafe_code)]
    unsafe {
        libc::close(a);
        libc::close(z);
    }

    // Frame MACs: the key schedule once per operation, then one tag per frame.
    let key = uuid::Uuid::new_v4().to_string();
    let frame = [7u8; 48];
    rows.push((
        "HMAC-SHA256 key schedule (once per operation and side)",
        time(N, || {
            std::hint::black_box(hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).unwrap());
        }),
        "2",
    ));
    let keyed = hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).unwrap();
    rows.push((
        "HMAC-SHA256 of one frame (tag or check)",
        time(N, || {
            let mut m = keyed.clone();
            m.update(&frame);
            std::hint::black_box(m.finalize().into_bytes());
        }),
        "4 (Req and Grant, each signed and checked)",
    ));

    if json {
        for (what, us, count) in &rows {
            println!(
                "{}",
                serde_json::json!({"hop": what, "median_us": us, "per_read": count})
            );
        }
    } else {
        println!("{:<62} {:>10}  per 4 KiB read", "hop", "median µs");
        for (what, us, count) in &rows {
            println!("{what:<62} {us:>10.2}  {count}");
        }
    }
}
