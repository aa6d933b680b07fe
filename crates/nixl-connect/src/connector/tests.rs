use super::*;

#[test]
fn connector_wait_spin_env_reads_microseconds() {
    assert_eq!(wait_spin_from_env(None).unwrap(), None);
    assert_eq!(wait_spin_from_env(Some(" ")).unwrap(), None);
    assert_eq!(wait_spin_from_env(Some("0")).unwrap(), Some(Duration::ZERO));
    assert_eq!(
        wait_spin_from_env(Some("150")).unwrap().unwrap(),
        Duration::from_micros(150)
    );
    for bad in ["-1", "+100", "1.5", "100us", "lots", "99999999999999999999999"] {
        let e = wait_spin_from_env(Some(bad)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
        assert!(e.to_string().contains(WAIT_SPIN_ENV), "{e}");
    }
}
