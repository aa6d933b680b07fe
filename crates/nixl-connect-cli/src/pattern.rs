//! A deterministic byte pattern both processes can compute, and a cheap checksum.

/// Fills `buf` with the pattern for `seed`, starting at absolute offset `offset`.
pub(crate) fn fill(buf: &mut [u8], seed: u64, offset: usize) {
    let mut i = offset;
    // 8 bytes at a time: the pattern is a function of the 8-byte word index.
    let (head, words, tail) = {
        let lead = (8 - (offset % 8)) % 8;
        let lead = lead.min(buf.len());
        let (h, rest) = buf.split_at_mut(lead);
        let n = rest.len() / 8 * 8;
        let (w, t) = rest.split_at_mut(n);
        (h, w, t)
    };
    for b in head.iter_mut() {
        *b = byte_at(seed, i);
        i += 1;
    }
    for chunk in words.chunks_exact_mut(8) {
        chunk.copy_from_slice(&word(seed, i / 8).to_le_bytes());
        i += 8;
    }
    for b in tail.iter_mut() {
        *b = byte_at(seed, i);
        i += 1;
    }
}

fn word(seed: u64, idx: usize) -> u64 {
    let mut x = seed ^ (idx as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

fn byte_at(seed: u64, i: usize) -> u8 {
    word(seed, i / 8).to_le_bytes()[i % 8]
}

/// Returns the index of the first byte that differs from the pattern, if any.
pub(crate) fn first_mismatch(buf: &[u8], seed: u64, offset: usize) -> Option<usize> {
    let mut expect = vec![0u8; buf.len().min(1 << 20)];
    let mut done = 0;
    while done < buf.len() {
        let n = (buf.len() - done).min(expect.len());
        fill(&mut expect[..n], seed, offset + done);
        if buf[done..done + n] != expect[..n] {
            let j = buf[done..done + n]
                .iter()
                .zip(&expect[..n])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Some(done + j);
        }
        done += n;
    }
    None
}

/// FNV-1a over 8-byte words (fast enough for GiB files), as hex.
pub(crate) fn checksum(parts: &[&[u8]]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut len = 0u64;
    for p in parts {
        let mut chunks = p.chunks_exact(8);
        for c in &mut chunks {
            h ^= u64::from_le_bytes(c.try_into().expect("8 bytes"));
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for &b in chunks.remainder() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        len += p.len() as u64;
    }
    format!("{h:016x}-{len}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_offset_consistent() {
        let mut whole = vec![0u8; 1000];
        fill(&mut whole, 7, 0);
        let mut part = vec![0u8; 333];
        fill(&mut part, 7, 101);
        assert_eq!(&whole[101..434], &part[..]);
        assert_eq!(first_mismatch(&whole, 7, 0), None);
        whole[500] ^= 1;
        assert_eq!(first_mismatch(&whole, 7, 0), Some(500));
    }
}
