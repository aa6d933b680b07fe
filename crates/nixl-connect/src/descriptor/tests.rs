use super::*;

#[test]
fn descriptor_reports_owned_and_borrowed_memory() {
    let v = vec![7u32; 16];
    let d = Descriptor::from(v);
    assert_eq!(d.size(), 64);
    assert!(d.is_writable());
    assert!(d.owns::<Vec<u32>>());
    assert!(!d.owns::<Vec<u8>>());
    let v: Vec<u32> = d.into_inner().unwrap();
    assert_eq!(v, vec![7u32; 16]);

    let data = [1u8, 2, 3];
    let d = Descriptor::from(&data[..]);
    assert!(!d.is_writable());
    assert_eq!(d.as_slice().unwrap(), &[1, 2, 3]);
    assert_eq!(d.metadata().size, 3);
    assert!(d.into_inner::<Vec<u8>>().is_err());
}

#[test]
#[allow(unsafe_code)]
fn descriptor_list_checks() {
    let ro = [0u8; 8];
    let list = vec![Descriptor::from(&ro[..])];
    assert!(check_local(&list, false).is_ok());
    assert!(matches!(check_local(&list, true), Err(Error::InvalidArgument(_))));
    assert!(matches!(check_local(&[], false), Err(Error::InvalidArgument(_))));
    let mut a = vec![0u8; 8];
    // SAFETY: test-only raw descriptor that is never used for a transfer.
    let gpu = unsafe { Descriptor::from_raw_parts(a.as_mut_ptr(), 8, Device::Cuda(0)) };
    let mixed = vec![Descriptor::from(vec![0u8; 8]), gpu];
    assert!(check_local(&mixed, false)
        .unwrap_err()
        .to_string()
        .contains("mixes device kinds"));
}
