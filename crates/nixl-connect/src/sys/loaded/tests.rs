use super::LoadWatch;

/// Whether this process maps a file whose name starts with `prefix`.
fn mapped(prefix: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .any(|f| f.starts_with(prefix))
}

#[test]
fn sys_load_watch_sees_a_library_loaded_after_it_answered_no() {
    // glibc's libBrokenLocale: on every glibc system, and loaded by nothing else here (zlib
    // was the first choice, but a test that loads NIXL concurrently brings it in).
    let watch = LoadWatch::new(b"libBrokenLocale.so");
    if mapped("libBrokenLocale.so") {
        assert!(watch.loaded());
        return;
    }
    assert!(!watch.loaded(), "a whole walk finds no libBrokenLocale");
    assert!(!watch.loaded(), "the kept answer, nothing loaded since");
    // SAFETY: loading libBrokenLocale runs only its own initialisers; it is never closed.
    let lib = unsafe {
        libc::dlopen(
            c"libBrokenLocale.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    assert!(!lib.is_null(), "glibc's libBrokenLocale is installed");
    assert!(
        watch.loaded(),
        "the loader's count moved: walked again, and found"
    );
    assert!(watch.loaded(), "once seen, kept");
}
