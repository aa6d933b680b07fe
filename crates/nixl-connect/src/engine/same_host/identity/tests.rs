use super::*;

fn welcome<'a>(
    nonce: &'a Nonce,
    client_id: u64,
    server_id: u64,
    proof: Option<&'a Tag>,
    pipes: bool,
) -> Welcome<'a> {
    Welcome {
        nonce,
        client_id,
        server_id,
        proof,
        pipes,
    }
}

#[test]
fn identity_advertisement_round_trips_and_python_names_advertise_nothing() {
    let id = Identity::from_seed([7; 32]);
    let name = id.advertise("worker-3");
    assert_eq!(advertised(&name), Some(id.fingerprint()));
    assert_eq!(
        advertised(&format!("{name}~2")),
        Some(id.fingerprint()),
        "a rotated exposer"
    );
    // Python Dynamo's agent names (uuid4 strings) and malformed advertisements.
    for n in [
        "5f0c8f5e-7a41-4c4e-9d59-0f2d3c4b5a69",
        "worker.nxc1-",
        "worker.nxc1-0123",
        "worker.nxc1-0123456789ABCDEF0123456789abcdef",
        "worker.nxc1-0123456789abcdef0123456789abcdefX",
        "worker.nxc1-0123456789abcdef0123456789abcdeg",
        "",
    ] {
        assert_eq!(advertised(n), None, "{n}");
    }
}

#[test]
fn identity_welcome_checks_key_fingerprint_nonce_ids_proof_and_pipes() {
    let id = Identity::from_seed([1; 32]);
    let other = Identity::from_seed([2; 32]);
    let n = [3u8; 16];
    let proof = [9u8; 32];
    let (public, sig) = id.sign_welcome(&welcome(&n, 10, 20, Some(&proof), false));
    let fp = id.fingerprint();
    assert!(verify_welcome(
        &fp,
        &public,
        &sig,
        &welcome(&n, 10, 20, Some(&proof), false)
    ));
    assert!(!verify_welcome(
        &other.fingerprint(),
        &public,
        &sig,
        &welcome(&n, 10, 20, Some(&proof), false)
    ));
    assert!(
        !verify_welcome(
            &fp,
            &public,
            &sig,
            &welcome(&[4; 16], 10, 20, Some(&proof), false)
        ),
        "nonce"
    );
    assert!(
        !verify_welcome(&fp, &public, &sig, &welcome(&n, 11, 20, Some(&proof), false)),
        "a relay's pid"
    );
    assert!(
        !verify_welcome(&fp, &public, &sig, &welcome(&n, 10, 20, None, false)),
        "proof dropped"
    );
    assert!(
        !verify_welcome(&fp, &public, &sig, &welcome(&n, 10, 20, Some(&proof), true)),
        "the pipes flag changed"
    );
    assert!(
        !verify_welcome(&fp, &public, &sig, &welcome(&n, 10, 20, Some(&[8; 32]), false)),
        "proof changed"
    );
    // Another key that signs correctly, but is not the advertised one.
    let (p2, s2) = other.sign_welcome(&welcome(&n, 10, 20, Some(&proof), false));
    assert!(!verify_welcome(
        &fp,
        &p2,
        &s2,
        &welcome(&n, 10, 20, Some(&proof), false)
    ));
    // The advertised key with a signature that is not its own.
    assert!(!verify_welcome(
        &fp,
        &public,
        &s2,
        &welcome(&n, 10, 20, Some(&proof), false)
    ));
    assert!(
        !format!("{id:?}").contains(&hex(&[1; 32])),
        "no private key in Debug"
    );
}
