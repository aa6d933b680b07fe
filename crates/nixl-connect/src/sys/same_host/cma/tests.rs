//! The copy pool and pulls, against this process's own memory (a `userfaultfd` range for a peer
//! that stalls).

use super::*;

/// Memory of this process whose pages never come until the `userfaultfd` is dropped: a
/// `process_vm_readv` of it blocks in the kernel (as a hostile peer's FUSE file or unserved
/// `userfaultfd` range would), then finds zero pages.
struct Stalled {
    ptr: usize,
    uffd: OwnedFd,
}

impl Stalled {
    fn new(len: usize) -> Option<Self> {
        // SAFETY: plain syscalls on fresh descriptors and a fresh mapping, each checked.
        unsafe {
            let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK);
            if fd < 0 {
                return None; // not root and vm.unprivileged_userfaultfd=0: skip
            }
            let uffd = OwnedFd::from_raw_fd(fd as i32);
            let mut api = [0xAAu64, 0, 0];
            assert_eq!(libc::ioctl(uffd.as_raw_fd(), 0xc018_aa3f, api.as_mut_ptr()), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let mut reg = [p as u64, len as u64, 1, 0];
            assert_eq!(libc::ioctl(uffd.as_raw_fd(), 0xc020_aa00, reg.as_mut_ptr()), 0);
            Some(Self {
                ptr: p as usize,
                uffd,
            })
        }
    }
}

/// Issue 27: the pool's cap was `per_peer + 56` threads, so enough peers stalling their
/// pages (eight on a 16-core host) held every thread and every other same-host copy of the
/// process waited forever. Now each peer holding threads adds its share to the cap: stalled
/// peers hold their own copies and the threads running them, and a copy from anyone else
/// still runs. The "peers" here are threads of this process (`process_vm_readv` takes a
/// thread id), each stalling on a `userfaultfd` range.
#[test]
fn cma_stalled_peers_cannot_starve_the_pool() {
    let Some(stall) = Stalled::new(4 << 20) else {
        eprintln!("skipped: userfaultfd is not available to this user");
        return;
    };
    let per_peer = pool().per_peer;
    let peers = (per_peer + MAX_SPARE) / per_peer + 4;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut parked = Vec::new();
    for _ in 0..peers {
        let tx = tx.clone();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        parked.push((
            go,
            std::thread::spawn(move || {
                // SAFETY: gettid has no preconditions.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = wait.recv();
            }),
        ));
    }
    let tids: Vec<libc::pid_t> = (0..peers).map(|_| rx.recv().unwrap()).collect();
    let table = Arc::new(SlotTable::create().unwrap());
    let mut sink = vec![0u8; 4096 * peers * per_peer];
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut slot = 0u32;
    let mut copy = |pid: libc::pid_t, local: usize, remote: usize| {
        slot += 1;
        table.arm(slot, 1);
        let done_tx = done_tx.clone();
        let c = Pull {
            pid,
            pieces: vec![Piece {
                local,
                remote,
                len: 4096,
            }],
            slot: SlotRef {
                table: table.clone(),
                idx: slot,
                gen: 1,
            },
            cancel: Arc::new(AtomicBool::new(false)),
        };
        spawn(c, Box::new(move |r| done_tx.send((pid, r)).unwrap())).unwrap();
    };
    for (k, &tid) in tids.iter().enumerate() {
        for j in 0..per_peer {
            let at = (k * per_peer + j) * 4096;
            copy(tid, sink.as_mut_ptr() as usize + at, stall.ptr + at % (4 << 20));
        }
    }
    // Every stalled copy holds its thread now; a copy from memory that is there must run.
    let src = vec![5u8; 4096];
    let mut dst = vec![0u8; 4096];
    let me = std::process::id() as libc::pid_t;
    copy(me, dst.as_mut_ptr() as usize, src.as_ptr() as usize);
    let got = done_rx.recv_timeout(Duration::from_secs(20));
    if got.is_err() {
        let st = lock(&pool().state);
        eprintln!(
            "threads {} idle {} queued {} peers {} running {}",
            st.threads,
            st.idle,
            st.queue.len(),
            st.peers.len(),
            st.peers.values().map(|l| l.running).sum::<usize>()
        );
    }
    let (pid, r) = got.expect("a copy from a well-behaved peer ran while others stalled");
    assert_eq!(
        pid, me,
        "only the well-behaved copy can end while the pages stall"
    );
    r.unwrap();
    assert_eq!(dst, src);
    // The stalled copies end once the pages come (zero pages when the fd closes).
    drop(stall.uffd);
    for _ in 0..peers * per_peer {
        let (_, r) = done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("stalled copies end");
        r.unwrap();
    }
    for (go, h) in parked {
        drop(go);
        h.join().unwrap();
    }
    drop(sink);
}

#[test]
fn cma_pull_copies_many_pieces_in_batches() {
    let src: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    // 2,000 pieces (more than IOV_MAX) of unequal sizes, plus a zero-length one.
    let mut pieces = Vec::new();
    let mut at = 0;
    let mut n = 1;
    while at < src.len() {
        let len = (n * 37 % 3000).min(src.len() - at);
        pieces.push(Piece {
            local: dst.as_mut_ptr() as usize + at,
            remote: src.as_ptr() as usize + at,
            len,
        });
        at += len;
        n += 1;
    }
    pull(std::process::id() as i32, &pieces, &AtomicBool::new(false)).unwrap();
    assert!(dst == src);
}

#[test]
fn cma_pull_of_nothing_succeeds() {
    let mut dst = [0u8; 1];
    let empty = Piece {
        local: dst.as_mut_ptr() as usize,
        remote: dst.as_ptr() as usize,
        len: 0,
    };
    pull(std::process::id() as i32, &[], &AtomicBool::new(false)).unwrap();
    pull(
        std::process::id() as i32,
        &[empty, empty],
        &AtomicBool::new(false),
    )
    .unwrap();
}

#[test]
fn cma_pull_reports_a_bad_address() {
    let mut dst = [0u8; 16];
    let p = Piece {
        local: dst.as_mut_ptr() as usize,
        remote: 8,
        len: 16,
    };
    assert!(matches!(
        pull(std::process::id() as i32, &[p], &AtomicBool::new(false)),
        Err(CopyError::Os(_))
    ));
}

#[test]
fn cma_coalesce_joins_only_pieces_adjacent_on_both_sides() {
    let p = |local, remote, len| Piece { local, remote, len };
    let got = coalesce(vec![
        p(100, 1000, 10),
        p(110, 1010, 5), // continues both sides: joined
        p(115, 2000, 5), // local continues, remote does not: kept apart
        p(120, 2005, 0), // empty: dropped
        p(130, 2005, 4), // remote continues, local does not: kept apart
        p(134, 2009, 6), // continues both: joined
        p(usize::MAX - 3, 10, 3),
        p(0, 13, 1), // would wrap around: kept apart
    ]);
    assert_eq!(
        got,
        vec![
            p(100, 1000, 15),
            p(115, 2000, 5),
            p(130, 2005, 10),
            p(usize::MAX - 3, 10, 3),
            p(0, 13, 1)
        ]
    );
}

/// A copy of many small scattered ranges (a gap between each, on both sides) is split across
/// threads by its ranges, not its bytes, and still moves every byte and nothing in the gaps.
#[test]
fn cma_copy_of_many_scattered_ranges_moves_every_byte_and_no_gap() {
    const N: usize = 1000;
    const S: usize = 4096;
    let src: Vec<u8> = (0..2 * N * S).map(|i| (i * 13 % 251) as u8 + 1).collect();
    let mut dst = vec![0u8; 2 * N * S];
    let table = Arc::new(SlotTable::create().unwrap());
    table.arm(2, 9);
    let pieces = (0..N)
        .map(|i| Piece {
            local: dst.as_mut_ptr() as usize + 2 * i * S,
            remote: src.as_ptr() as usize + 2 * i * S,
            len: S,
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut c = copy_of(&table, 2, 9, 0, 0, 0);
    c.pieces = pieces;
    spawn(c, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    assert_eq!(rx.recv().unwrap(), Ok(()));
    for i in 0..N {
        let (at, gap) = (2 * i * S, (2 * i + 1) * S);
        assert!(dst[at..at + S] == src[at..at + S], "range {i} moved");
        assert!(
            dst[gap..gap + S].iter().all(|&b| b == 0),
            "gap after range {i} untouched"
        );
    }
    assert_eq!(table.revoke(2, 9), DONE);
}

/// A copy of `len` bytes from `remote` in this process to `local`, guarded by slot `idx` of
/// `table` at generation `gen`.
fn copy_of(table: &Arc<SlotTable>, idx: u32, gen: u64, local: usize, remote: usize, len: usize) -> Pull {
    Pull {
        pid: std::process::id() as i32,
        pieces: vec![Piece { local, remote, len }],
        slot: SlotRef {
            table: table.clone(),
            idx,
            gen,
        },
        cancel: Arc::new(AtomicBool::new(false)),
    }
}

#[test]
fn cma_spawn_splits_and_reports_once() {
    let src = vec![9u8; 40 << 20];
    let mut dst = vec![0u8; 40 << 20];
    let table = Arc::new(SlotTable::create().unwrap());
    table.arm(1, 5);
    let (tx, rx) = std::sync::mpsc::channel();
    spawn(
        copy_of(
            &table,
            1,
            5,
            dst.as_mut_ptr() as usize,
            src.as_ptr() as usize,
            src.len(),
        ),
        Box::new(move |r| tx.send(r).unwrap()),
    )
    .unwrap();
    assert_eq!(rx.recv().unwrap(), Ok(()));
    assert!(rx.try_recv().is_err(), "done runs once");
    assert!(dst == src);
    assert_eq!(table.revoke(1, 5), DONE);
}

/// Small copies started together (as in one engine turn) reach the pool as one job, and a
/// batch where one copy faults or is revoked still reports each copy on its own: the others
/// succeed with their bytes, the faulting one fails, the revoked one says so.
#[test]
fn cma_batched_copies_run_as_one_job_and_each_reports_alone() {
    const N: usize = 8;
    let srcs: Vec<Vec<u8>> = (0..N).map(|k| vec![k as u8 + 1; 4096]).collect();
    let mut dsts: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; 4096]).collect();
    let big_src = vec![0xAB; 1 << 20];
    let mut big_dst = vec![0u8; 1 << 20];
    let table = Arc::new(SlotTable::create().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let mut batch = Batch::default();
    let start = |batch: &mut Batch, idx: u32, local: usize, remote: usize, len: usize| {
        table.arm(idx, 7);
        let tx = tx.clone();
        spawn_into(
            batch,
            copy_of(&table, idx, 7, local, remote, len),
            Box::new(move |r| tx.send((idx, r)).unwrap()),
        )
        .unwrap();
    };
    for k in 0..N {
        // Copy 2 reads from an address nothing maps.
        let remote = if k == 2 { 8 } else { srcs[k].as_ptr() as usize };
        start(
            &mut batch,
            k as u32 + 1,
            dsts[k].as_mut_ptr() as usize,
            remote,
            4096,
        );
    }
    start(
        &mut batch,
        N as u32 + 1,
        big_dst.as_mut_ptr() as usize,
        big_src.as_ptr() as usize,
        big_src.len(),
    );
    assert_eq!(
        batch.jobs.len(),
        2,
        "the small copies share one job; the large one has its own"
    );
    assert_eq!(batch.jobs[0].parts.len(), N);
    // Copy 4's owner revokes it after it started, before it ran.
    assert_eq!(table.revoke(5, 7), COPYING);
    batch.submit();
    assert!(batch.is_empty());
    let mut got: Vec<(u32, Result<(), CopyError>)> = (0..=N)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(20))
                .expect("every copy reports")
        })
        .collect();
    got.sort_by_key(|(i, _)| *i);
    for (i, r) in got {
        let k = i as usize - 1;
        match k {
            2 => assert!(matches!(r, Err(CopyError::Os(_))), "the fault is copy 2's: {r:?}"),
            4 => assert_eq!(r, Err(CopyError::Revoked)),
            N => {
                assert_eq!(r, Ok(()));
                assert!(big_dst == big_src);
            }
            _ => {
                assert_eq!(r, Ok(()), "copy {k}");
                assert_eq!(dsts[k], srcs[k], "copy {k} moved its own bytes");
            }
        }
    }
    assert!(rx.try_recv().is_err(), "each copy reports once");
}

/// A batch of copies whose pulls all succeed moves every one's bytes (in one system call), and
/// one revoked meanwhile still reports its revocation.
#[test]
fn cma_batched_copies_that_all_succeed_move_every_byte() {
    let srcs: Vec<Vec<u8>> = (0..64).map(|k| vec![k as u8; 4096 + k]).collect();
    let mut dsts: Vec<Vec<u8>> = srcs.iter().map(|s| vec![0xFF; s.len()]).collect();
    let table = Arc::new(SlotTable::create().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let mut batch = Batch::default();
    for (k, (s, d)) in srcs.iter().zip(dsts.iter_mut()).enumerate() {
        table.arm(k as u32, 3);
        let tx = tx.clone();
        spawn_into(
            &mut batch,
            copy_of(
                &table,
                k as u32,
                3,
                d.as_mut_ptr() as usize,
                s.as_ptr() as usize,
                s.len(),
            ),
            Box::new(move |r| tx.send((k, r)).unwrap()),
        )
        .unwrap();
    }
    assert_eq!(batch.jobs.len(), 2, "256 KiB of small copies a job");
    assert_eq!(table.revoke(10, 3), COPYING);
    batch.submit();
    for _ in 0..64 {
        let (k, r) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(
            r,
            if k == 10 { Err(CopyError::Revoked) } else { Ok(()) },
            "copy {k}"
        );
    }
    assert!(dsts == srcs);
}

/// A job of a peer that may run.
fn queued_job(pid: libc::pid_t) -> Job {
    Job {
        pid,
        parts: Vec::new(),
        bytes: 0,
        batched: false,
    }
}

/// Two submits while one thread spins (counted hot until it takes a job): the second must wake
/// a sleeping thread, or its job waits behind the first, whose peer may stall it for good (the
/// review's interleaving: the wake count was taken from the jobs of each submit alone).
#[test]
fn cma_pool_submits_while_a_thread_spins_leave_no_job_without_a_thread() {
    let mut st = PoolState {
        hot: 1,
        idle: 7,
        ..PoolState::default()
    };
    st.push(queued_job(1001));
    assert_eq!(st.wakes(2), 0, "the spinning thread takes the first job");
    st.push(queued_job(1002));
    assert_eq!(st.wakes(2), 1, "the second job needs a sleeping thread woken");
    // Jobs held back by their peer's share need no thread.
    st.peers.entry(1003).or_default().running = 2;
    st.push(queued_job(1003));
    assert_eq!(st.wakes(2), 1);
    // Never more than sleep.
    for _ in 0..20 {
        st.push(queued_job(1004 + st.queue.len() as i32));
    }
    assert_eq!(st.wakes(2), 7);
}
