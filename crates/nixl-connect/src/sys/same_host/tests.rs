use super::*;

#[test]
fn sys_cuda_export_check_refuses_what_is_no_nvidia_device() {
    let mut p = [0; 2];
    // SAFETY: makes a pipe whose two descriptors become owned just below.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the two descriptors pipe2 just made, owned once each.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    assert!(!is_cuda_export(&r));
    assert!(!is_cuda_export(&w));
    let null = OwnedFd::from(std::fs::File::open("/dev/null").unwrap()); // a character device, 1:3
    assert!(!is_cuda_export(&null));
    let dir = OwnedFd::from(std::fs::File::open("/").unwrap());
    assert!(!is_cuda_export(&dir));
}
