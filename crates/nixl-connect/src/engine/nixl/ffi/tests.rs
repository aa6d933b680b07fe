use super::*;

#[test]
fn nixl_version_read_beside_the_library() {
    let root = std::env::temp_dir().join(format!("nc-version-{}", std::process::id()));
    let wheel = root.join("site/.nixl_cu13.mesonpy.libs");
    std::fs::create_dir_all(&wheel).unwrap();
    std::fs::create_dir_all(root.join("site/nixl_cu13-1.4.1.dist-info")).unwrap();
    assert_eq!(version_beside(&wheel.join(CAPI)).as_deref(), Some("1.4.1"));
    let setup = root.join("setup/.nixl/lib");
    std::fs::create_dir_all(&setup).unwrap();
    std::fs::write(root.join("setup/.nixl/VERSION"), "nixl-cu13==1.5.1\n").unwrap();
    assert_eq!(version_beside(&setup.join(CAPI)).as_deref(), Some("1.5.1"));
    assert_eq!(version_beside(&root.join("bare").join(CAPI)), None);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn nixl_version_supported_releases_are_the_pinned_ones() {
    for v in ["1.4.1", "1.5.0", "1.5.1", " 1.5.2 "] {
        assert!(supported_release(v), "{v}");
    }
    for v in ["1.3.0", "1.6.0", "2.5.1", "1", "", "1.45.0", "11.5.0"] {
        assert!(!supported_release(v), "{v}");
    }
}
