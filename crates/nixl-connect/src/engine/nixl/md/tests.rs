use super::*;

#[test]
fn md_parses_name_and_boundary() {
    let b = blob("worker-1", &[b"conn|info with | bars"], 1);
    let md = parse(&b).unwrap();
    assert_eq!(md.name, "worker-1");
    assert_eq!(md.conns, 1);
    assert!(b[md.sections_at..].starts_with(b"\x0a\0\0\0\0\0\0\0MemSection|"));
}

#[test]
fn md_splices_connections_with_sections() {
    let conn = blob("a", &[b"CONN"], 0);
    let secs = blob("a", &[], 7);
    let out = splice(&conn, &secs).unwrap();
    assert_eq!(out, blob("a", &[b"CONN"], 7));
    assert!(parse(&out).is_ok());
    assert!(splice(&conn, &blob("b", &[], 0)).is_err());
}

#[test]
fn md_refuses_trailing_bytes_and_impossible_counts() {
    let good = blob("name", &[b"xyz"], 2);
    assert!(parse(&good).is_ok());
    let mut padded = good.clone();
    padded.resize(good.len() + 4096, 0);
    let e = parse(&padded).unwrap_err().to_string();
    assert!(e.contains("trailing bytes"), "{e}");
    // A descriptor count no blob of this size can hold.
    let at = good.windows(2).position(|w| w == b"n\x08").unwrap() + 9;
    let mut huge = good.clone();
    huge[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = parse(&huge).unwrap_err().to_string();
    assert!(e.contains("more than the bytes left"), "{e}");
    let mut secs = good.clone();
    let at = good.windows(12).position(|w| w == b"nixlSecElms\x08").unwrap() + 19;
    secs[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse(&secs).is_err());
}

#[test]
fn md_rejects_garbage_without_panicking() {
    let good = blob("name", &[b"xyz"], 3);
    assert!(parse(b"").is_err());
    assert!(parse(b"nixlSerDes|").is_err());
    assert!(parse(&good[..good.len() - 30]).is_err());
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..20_000 {
        let mut m = good.clone();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x as usize) % m.len();
        match i % 3 {
            0 => m[at] = (x >> 32) as u8,
            1 => m.truncate(at),
            _ => m.insert(at, (x >> 40) as u8),
        }
        let _ = parse(&m);
    }
}
