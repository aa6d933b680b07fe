use super::*;

#[test]
fn encoding_matches_python() {
    // Python: "b64:" + base64.b64encode(zlib.compress(b"nixlSerDes|example", 6)).decode()
    const PY: &str = "b64:eJzLy6zICU4tckktrkmtSMwtyEkFAEYgB2o=";
    assert_eq!(encode(b"nixlSerDes|example"), PY);
    assert_eq!(decode(PY).unwrap(), b"nixlSerDes|example");
    // The older hex form decodes to the same bytes.
    let hex = "789ccbcbacc8094e2d72492dae49ad48cc2dc84905004620076a";
    assert_eq!(decode(hex).unwrap(), b"nixlSerDes|example");
}

#[test]
fn encoding_accepts_hex() {
    let b64 = encode(b"hello agent");
    let raw = base64::engine::general_purpose::STANDARD
        .decode(&b64[4..])
        .unwrap();
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(to_hex(&b64).unwrap(), hex);
    assert_eq!(to_hex(&hex).unwrap(), hex, "hex stays hex");
    assert_eq!(decode(&hex).unwrap(), b"hello agent");
    assert!(to_hex("b64:!!").is_err());
}

#[test]
fn encoding_refuses_bad_strings_with_a_typed_problem() {
    for (s, want) in [
        ("b64:!!!", MetadataProblem::Base64),
        ("b64:aGVsbG8=", MetadataProblem::Zlib),
        ("zz", MetadataProblem::NotBase64NorHex),
        ("abc", MetadataProblem::NotBase64NorHex),
        ("00ff", MetadataProblem::Zlib),
        ("b64:", MetadataProblem::Zlib),
        ("", MetadataProblem::Zlib),
    ] {
        match decode(s) {
            Err(Error::Metadata { field, problem, .. }) => {
                assert_eq!(field, FIELD, "{s}");
                assert_eq!(problem, want, "{s}");
            }
            other => panic!("{s}: {other:?}"),
        }
    }
}

/// The reused compressor and decompressor: any size round trips (output grown past its first
/// guess, on a thread that just decoded something else), a stream cut anywhere is a typed
/// `Zlib` problem, and bytes after a stream's end are ignored (as the streaming decoder did).
#[test]
fn encoding_round_trips_any_size_and_refuses_truncated_streams() {
    let mut x = 0x9e37_79b9_u32;
    for n in [1usize, 100, 484, 1023, 1024, 5000, 70_000, 300_000] {
        let md: Vec<u8> = (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if i % 3 == 0 {
                    x as u8
                } else {
                    b'a' + (i % 5) as u8
                }
            })
            .collect();
        let s = encode(&md);
        assert_eq!(decode(&s).unwrap(), md, "{n} bytes");
        let z = base64::engine::general_purpose::STANDARD.decode(&s[4..]).unwrap();
        let mut more = z.clone();
        more.extend_from_slice(b"trailing");
        let hex: String = more.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(decode(&hex).unwrap(), md, "{n} bytes, trailing bytes ignored");
        for cut in [1, z.len() / 2, z.len() - 1] {
            let hex: String = z[..cut].iter().map(|b| format!("{b:02x}")).collect();
            match decode(&hex) {
                Err(Error::Metadata {
                    problem: MetadataProblem::Zlib,
                    ..
                }) => {}
                other => panic!("{n} bytes cut at {cut}: {other:?}"),
            }
        }
    }
}

#[test]
fn encoding_caps_decompression() {
    let big = vec![0u8; MAX_NIXL_METADATA + 1024];
    let bomb = encode(&big);
    assert!(bomb.len() < 64 << 10, "a zlib bomb is small: {}", bomb.len());
    let err = decode(&bomb).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Metadata {
                problem: MetadataProblem::TooLarge { .. },
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("more than"), "{err}");
}

#[test]
fn encoding_decodes_a_peer_once_into_its_name_and_identity() {
    let blob = md::blob("worker-7", &[b"conn"], 0);
    let p = decode_peer(&encode(&blob)).unwrap();
    assert_eq!(&*p.name, "worker-7");
    assert_eq!(&*p.reach, &blob[..]);
    assert_eq!(p.identity, md::identity(&blob).unwrap());
    assert!(decode_peer(&encode(b"not nixl")).is_err());
}
