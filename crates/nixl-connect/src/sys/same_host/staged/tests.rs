use super::*;

#[test]
fn staged_lanes_follow_the_cores_or_the_variable() {
    assert_eq!(lanes_from(None, 2), 1);
    assert_eq!(lanes_from(None, 16), 8);
    assert_eq!(lanes_from(None, 64), MAX_WORKERS);
    assert_eq!(lanes_from(Some("12"), 2), 12);
    assert_eq!(lanes_from(Some("99"), 16), MAX_LANES);
    assert_eq!(lanes_from(Some("0"), 16), 8);
    assert_eq!(lanes_from(Some("many"), 16), 8);
}

/// Issue 27: `chunks()` built one entry per 8 MiB of every range (524K ranges over a
/// 16 GiB writable: ~10^9 entries). Chunks are now computed as they are taken, from one
/// entry per range.
#[test]
fn staged_chunks_are_computed_not_listed() {
    let piece = |local, remote, len| Piece { local, remote, len };
    let c = Chunks::new(
        vec![
            piece(0x1000, 0x9000, 0),
            piece(0x10_0000, 0x90_0000, 2 * CHUNK + 5),
            piece(0x7000_0000, 0x8000_0000, 1),
        ],
        CHUNK,
    );
    assert_eq!(c.total, 4);
    assert_eq!(c.get(0), Some(piece(0x10_0000, 0x90_0000, CHUNK)));
    assert_eq!(c.get(1), Some(piece(0x10_0000 + CHUNK, 0x90_0000 + CHUNK, CHUNK)));
    assert_eq!(
        c.get(2),
        Some(piece(0x10_0000 + 2 * CHUNK, 0x90_0000 + 2 * CHUNK, 5))
    );
    assert_eq!(c.get(3), Some(piece(0x7000_0000, 0x8000_0000, 1)));
    assert_eq!(c.get(4), None);
    // 524,288 ranges of 32 KiB over 16 GiB: one entry each, not one per chunk of each.
    let many: Vec<Piece> = (0..524_288usize)
        .map(|i| piece(i << 15, i << 15, 32 << 10))
        .collect();
    let c = Chunks::new(many, CHUNK);
    assert_eq!(c.total, 524_288);
    assert_eq!(c.starts.len(), 524_288);
    assert_eq!(c.get(524_287).map(|p| p.local), Some(524_287 << 15));
    let huge = Chunks::new(vec![piece(0, 0, 16 << 30)], CHUNK);
    assert_eq!((huge.total, huge.starts.len()), ((16 << 30) / CHUNK, 1));
}
