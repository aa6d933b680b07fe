use std::error::Error as _;

use super::*;

#[test]
fn transport_decline_becomes_path_unavailable_with_its_source() {
    let e = Decline::from(PathRefusal::NoCudaSupport).into_error("peer-1");
    assert_eq!(e.kind(), crate::error::ErrorKind::PathUnavailable);
    assert!(!e.to_string().contains("no CUDA support"), "{e}");
    assert!(
        e.report().to_string().contains("no CUDA support"),
        "{}",
        e.report()
    );
    let src = e
        .source()
        .and_then(|s| s.downcast_ref::<ErrorSource>())
        .expect("the refusal");
    assert_eq!(
        src.downcast_ref::<PathRefusal>(),
        Some(&PathRefusal::NoCudaSupport)
    );

    let os = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
    let e = Decline::because("no same-host socket for this peer", os).into_error("peer-2");
    let io = e
        .source()
        .and_then(|s| s.downcast_ref::<ErrorSource>())
        .and_then(|s| s.downcast_ref::<std::io::Error>());
    assert_eq!(
        io.and_then(std::io::Error::raw_os_error),
        Some(libc::ECONNREFUSED)
    );
    assert!(Decline::from("off").into_error("p").source().is_none());
}
