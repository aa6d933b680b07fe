/// Every cause under `e`, and that no level's text repeats the level under it.
fn assert_each_cause_once(e: &Error) -> Vec<String> {
    let mut texts = vec![e.to_string()];
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        texts.push(c.to_string());
        cause = c.source();
    }
    for w in texts.windows(2) {
        assert!(!w[0].contains(&w[1]), "{:?} repeats its cause {:?}", w[0], w[1]);
    }
    texts
}

#[test]
fn error_refusal_is_typed_and_tells_a_replay() {
    for (r, replay) in [
        (Refusal::NotLive, true),
        (Refusal::AlreadyCompleted, true),
        (Refusal::OutOfRange, false),
        (Refusal::WrongDirection, false),
        (Refusal::Busy, false),
    ] {
        assert_eq!(r.is_replay(), replay, "{r:?}");
        let e = Error::Refused {
            agent: "peer-1".into(),
            refusal: r,
            reason: "what the peer said".into(),
        };
        assert_eq!(e.kind(), ErrorKind::Refused);
        assert!(e.to_string().contains(&r.to_string()), "{e}");
    }
}

#[test]
fn error_report_prints_each_cause_once() {
    let io = || std::io::Error::from_raw_os_error(libc::ENOMEM);
    let os = Error::os("mapping 1 GiB", io());
    let texts = assert_each_cause_once(&os);
    assert_eq!(texts.len(), 2, "Os and its io::Error: {texts:?}");
    let report = os.report().to_string();
    assert_eq!(report, format!("the OS refused mapping 1 GiB: {}", io()));
    assert_eq!(report.matches(&io().to_string()).count(), 1, "{report}");

    let channel = Error::channel_shared("cannot reach http://127.0.0.1:9/x", Arc::new(io()));
    assert_each_cause_once(&channel);
    let report = channel.report().to_string();
    assert_eq!(
        report,
        format!("metadata channel: cannot reach http://127.0.0.1:9/x: {}", io())
    );

    let gone = Error::RemoteGone {
        agent: "peer-1".into(),
        reason: "the transfer failed in UCX".into(),
        source: Some(Arc::new(io())),
    };
    assert_each_cause_once(&gone);
    assert!(gone.report().to_string().ends_with(&io().to_string()));
    // No source: the report is the Display.
    assert_eq!(
        Error::Cancelled.report().to_string(),
        Error::Cancelled.to_string()
    );
}

use std::error::Error as _;

use super::*;
use crate::device::Device;

#[test]
fn error_kind_is_the_variant_name() {
    let e = Error::TimedOut {
        after: std::time::Duration::from_secs(1),
        peer: None,
    };
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert_eq!(e.kind().as_str(), "TimedOut");
    assert_eq!(
        Error::InvalidArgument("x".into()).kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(Error::EngineStopped.kind(), ErrorKind::EngineStopped);
    // A device that names nothing is its own typed leaf, of the caller's kind.
    let dev = Error::from("tpu:0".parse::<Device>().unwrap_err());
    assert_eq!(dev.kind(), ErrorKind::InvalidArgument);
    assert!(matches!(&dev, Error::InvalidDevice(p) if p.input == "tpu:0"));
    assert!(dev.is_permanent());
    // Every kind's name is distinct and is its variant's.
    let names: std::collections::HashSet<_> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
    assert_eq!(names.len(), ErrorKind::ALL.len());
    // Every kind is its variant's name as `Debug` prints it.
    for e in [
        Error::Cancelled,
        Error::Channel("c".into()),
        Error::os("x", std::io::Error::other("y")),
    ] {
        assert!(format!("{e:?}").starts_with(e.kind().as_str()), "{e:?}");
    }
}

#[test]
fn error_os_keeps_its_io_source() {
    let e = Error::os(
        "mapping 4096 bytes",
        std::io::Error::from_raw_os_error(libc::ENOMEM),
    );
    let src = e.source().expect("a source");
    // Shared (the error is `Clone`): the source is the `Arc` around the `io::Error`.
    let io = src.downcast_ref::<Arc<std::io::Error>>().expect("the io::Error");
    assert_eq!(io.raw_os_error(), Some(libc::ENOMEM));
    assert_eq!(e.to_string(), "the OS refused mapping 4096 bytes");
    assert!(
        e.report()
            .to_string()
            .starts_with("the OS refused mapping 4096 bytes: "),
        "{}",
        e.report()
    );
    // No blanket `From<io::Error>`: every OS error names what it was refused.
    let from = Error::os(
        "opening a socket",
        std::io::Error::from_raw_os_error(libc::EMFILE),
    );
    assert!(from.source().is_some());
}

#[test]
fn error_channel_keeps_its_source() {
    let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
    let e = Error::channel_from("the reply is not JSON", json);
    assert_eq!(e.to_string(), "metadata channel: the reply is not JSON");
    assert!(
        e.report()
            .to_string()
            .starts_with("metadata channel: the reply is not JSON: "),
        "{}",
        e.report()
    );
    let src = e
        .source()
        .and_then(|s| s.downcast_ref::<ErrorSource>())
        .expect("a source");
    assert!(src.downcast_ref::<serde_json::Error>().is_some(), "{src:?}");
    let Error::Channel(c) = &e else { panic!("{e:?}") };
    // Reads as its message, as the `String` it replaced did.
    assert!(c.message().contains("not JSON") && c.message().starts_with("the reply"));
    assert!(Error::channel("the listener stopped").source().is_none());
    assert_eq!(e.kind(), ErrorKind::Channel);
}

#[test]
fn error_path_refusal_is_typed_and_reads_as_text() {
    match crate::same_host_path(Device::Host, Device::Cuda(0)) {
        Err(r) if !cfg!(feature = "cuda") => {
            assert_eq!(r, PathRefusal::HostIntoDevice);
            assert!(r.message().contains("host memory into device memory"), "{r}");
            assert_eq!(r.to_string(), r.message());
        }
        // A CUDA build on a host without a GPU.
        Err(r) => assert_eq!(r, PathRefusal::NoCudaDevice, "{r}"),
        // A CUDA build with a GPU: pulled through pinned staging.
        Ok(()) => {
            #[cfg(not(feature = "cuda"))]
            panic!("host into device memory on the same-host path needs the `cuda` feature")
        }
    }
    let r = crate::same_host_path(Device::Xpu(0), Device::Cuda(0)).unwrap_err();
    assert_eq!(r.to_string(), r.message());
    let xpu = crate::same_host_path(Device::Xpu(0), Device::Host).unwrap_err();
    assert_eq!(xpu, PathRefusal::UnsupportedMemory);
}
