use super::*;

#[test]
fn auth_proofs_bind_key_nonce_and_pids() {
    let n = nonce();
    assert_ne!(n, nonce(), "nonces are fresh");
    let p = welcome_proof("k1", &n, 10, 20);
    assert!(same(&p, &welcome_proof("k1", &n, 10, 20)));
    assert!(!same(&p, &welcome_proof("k2", &n, 10, 20)));
    assert!(!same(&p, &welcome_proof("k1", &nonce(), 10, 20)));
    assert!(
        !same(&p, &welcome_proof("k1", &n, 10, 21)),
        "a relay's pid differs"
    );
    let k1 = Keyed::new("k1");
    let r = frame_mac(&k1, &n, 10, 20, Side::Client, b"frame");
    assert!(same(
        &r,
        &frame_mac(&Keyed::new("k1"), &n, 10, 20, Side::Client, b"frame")
    ));
    assert!(!same(
        &r,
        &frame_mac(&Keyed::new("k2"), &n, 10, 20, Side::Client, b"frame")
    ));
    assert!(
        !same(&r, &frame_mac(&k1, &n, 10, 20, Side::Server, b"frame")),
        "direction"
    );
    assert!(
        !same(&r, &frame_mac(&k1, &n, 10, 21, Side::Client, b"frame")),
        "pids"
    );
    assert!(
        !same(&r, &frame_mac(&k1, &nonce(), 10, 20, Side::Client, b"frame")),
        "nonce"
    );
    assert!(
        !same(&r, &frame_mac(&k1, &n, 10, 20, Side::Client, b"frame!")),
        "fields"
    );
    assert_ne!(key_id("k1"), key_id("k2"));
    assert!(!key_id("k1").windows(2).any(|w| w == b"k1"));
}
