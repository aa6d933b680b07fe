use super::*;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A fork waits for a call into NIXL under way on another thread: the parent and the child
/// both see the call ended (without the gate, the fork returned while the call slept).
#[test]
fn sys_a_fork_waits_for_the_calls_into_nixl_in_flight() {
    count_forks();
    let done = Arc::new(AtomicBool::new(false));
    let (entered, inside) = std::sync::mpsc::channel();
    let call = {
        let done = done.clone();
        std::thread::spawn(move || {
            outside_fork(|| {
                entered.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                done.store(true, Ordering::SeqCst);
            })
        })
    };
    inside.recv().unwrap();
    // SAFETY: the child only reads an atomic and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(i32::from(!done.load(Ordering::SeqCst))) };
    }
    let ended_first = done.load(Ordering::SeqCst);
    let mut status = 0;
    // SAFETY: waits for this test's own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    call.join().unwrap();
    assert!(
        ended_first,
        "the fork returned while a call into NIXL was under way"
    );
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child saw the call under way: {status:#x}"
    );
    // A call made inside another does not take the gate again (with a fork waiting, it
    // would wait for itself).
    assert_eq!(outside_fork(|| outside_fork(|| 7)), 7);
}
