//! Stopping a child process and knowing that it has stopped (shared with the CLI's tests).
//!
//! `kill(2)` returns once SIGSTOP is queued, not once the process is stopped: the threads stop only
//! after one of them takes the signal, which on a busy host can be milliseconds later. A "stopped"
//! peer could still answer one more request in that window, so a test that needs it frozen waits
//! for every thread to show the stopped state in `/proc`.

use std::time::{Duration, Instant};

/// How long a stopped process may take to show every thread stopped before the test fails.
const STOP_LIMIT: Duration = Duration::from_secs(10);

/// Sends `sig` to the child `pid`; for SIGSTOP, returns only once every thread of it is stopped.
pub(crate) fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    #[allow(unsafe_code)]
    let r = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(r, 0, "signalling {pid}");
    if sig != libc::SIGSTOP {
        return;
    }
    let t0 = Instant::now();
    loop {
        let states = states(pid);
        if !states.is_empty() && states.iter().all(|&c| c == 'T') {
            return;
        }
        let exited = states.is_empty() || states.iter().any(|&c| matches!(c, 'Z' | 'X'));
        if exited || t0.elapsed() >= STOP_LIMIT {
            // SAFETY: kill(2) on our own child's pid: a child left stopped would outlive the test.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL)
            };
            if exited {
                panic!("{pid} exited before it could be stopped (thread states {states:?})");
            }
            panic!("{pid} did not stop within {STOP_LIMIT:?} (thread states {states:?})");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The state letter of each thread of `pid` (`/proc/PID/task/TID/stat`: `T` stopped, `Z` zombie);
/// none when the process is gone.
fn states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let s = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // The state follows the ")" that closes the command name (which may hold spaces).
            s.rsplit_once(") ")?.1.chars().next()
        })
        .collect()
}
