use super::*;

#[test]
fn buffer_is_aligned_and_zeroed() {
    for len in [0usize, 1, 4096, 5000, 3 << 20] {
        let b = HostBuffer::new(len).unwrap();
        assert_eq!(b.len(), len);
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
        assert_eq!(b.as_ptr() as usize % align, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(b.is_huge(), len >= HUGE_PAGE);
    }
}

#[test]
fn buffer_copies_from_slice() {
    let b = HostBuffer::from_slice(b"nixl").unwrap();
    assert_eq!(&b[..], b"nixl");
}
