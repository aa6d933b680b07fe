use super::*;

#[test]
fn device_round_trips_like_python() {
    for (s, d) in [
        ("cpu", Device::Host),
        ("cuda:0", Device::Cuda(0)),
        ("cuda:7", Device::Cuda(7)),
        ("xpu:2", Device::Xpu(2)),
    ] {
        assert_eq!(s.parse::<Device>().unwrap(), d);
        assert_eq!(d.to_string(), s);
    }
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    assert_eq!(" CPU ".parse::<Device>().unwrap(), Device::Host);
}

#[test]
fn device_rejects_unknown_strings() {
    for s in ["", "gpu0", "tpu:0", "cuda:x", "cuda0", "cpu:1", "cuda:-1"] {
        assert!(s.parse::<Device>().is_err(), "{s:?} should be rejected");
    }
}
