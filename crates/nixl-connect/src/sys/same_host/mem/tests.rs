use super::*;

fn range(mem: &[u8]) -> Range {
    Range {
        addr: mem.as_ptr() as usize,
        len: mem.len(),
        device: Device::Host,
    }
}

#[test]
fn mem_gather_then_scatter_moves_the_bytes_in_order() {
    let src: Vec<u8> = (0..100u8).collect();
    let base = src.as_ptr() as u64;
    let got = gather(&[range(&src)], &[(base + 10, 5), (base + 50, 3)]).unwrap();
    assert_eq!(got, [10, 11, 12, 13, 14, 50, 51, 52]);
    let mut dst = [0u8; 16];
    let own = [range(&dst)];
    let base = dst.as_mut_ptr() as u64;
    assert!(scatter(&own, &[(base + 1, 3), (base + 8, 5)], &got));
    assert_eq!(dst, [0, 10, 11, 12, 0, 0, 0, 0, 13, 14, 50, 51, 52, 0, 0, 0]);
}

/// An active operation's own ranges, copied whole: out in order, and in only when the bytes
/// are exactly as long.
#[test]
fn mem_all_of_an_operations_memory_moves_in_order() {
    let src: Vec<u8> = (0..16u8).collect();
    let own = [
        Range {
            addr: src.as_ptr() as usize + 8,
            len: 4,
            device: Device::Host,
        },
        Range {
            addr: src.as_ptr() as usize,
            len: 2,
            device: Device::Host,
        },
    ];
    assert_eq!(gather_all(&own).unwrap(), [8, 9, 10, 11, 0, 1]);
    let mut dst = [0u8; 6];
    let base = dst.as_mut_ptr() as usize;
    let at = |addr, len| Range {
        addr,
        len,
        device: Device::Host,
    };
    let into = [at(base + 3, 3), at(base, 3)];
    assert!(!scatter_all(&into, &[7; 5]));
    assert!(scatter_all(&into, &[1, 2, 3, 4, 5, 6]));
    assert_eq!(dst, [4, 5, 6, 1, 2, 3]);
    assert!(gather_all(&[]).is_none());
}

/// A pick outside the memory the operation owns, or lengths that do not add up, touch nothing.
#[test]
fn mem_picks_outside_own_memory_touch_nothing() {
    let mut dst = [0u8; 16];
    let own = [range(&dst)];
    let base = dst.as_mut_ptr() as u64;
    assert!(gather(&own, &[(base + 8, 9)]).is_none());
    assert!(gather(&own, &[]).is_none());
    assert!(gather(&own, &[(u64::MAX - 1, 4)]).is_none());
    assert!(!scatter(&own, &[(base, 4), (base + 14, 4)], &[1; 8]));
    assert!(!scatter(&own, &[(base, 4)], &[1; 5]));
    let device = [Range {
        device: Device::Cuda(0),
        ..own[0]
    }];
    assert!(!scatter(&device, &[(base, 4)], &[1; 4]));
    assert_eq!(dst, [0; 16]);
}
