use super::*;

fn sample() -> RdmaMetadata {
    RdmaMetadata {
        descriptors: vec![SerializedDescriptor {
            device: Device::Host,
            ptr: 140234,
            size: 4096,
        }],
        nixl_metadata: RdmaMetadata::encode_agent_metadata(b"agent-metadata"),
        notification_key: "0b7c3a43-4a4e-4c43-9a46-8e2c0e0b9a11".into(),
        operation_kind: 1,
    }
}

#[test]
fn metadata_json_matches_python_layout() {
    let md = RdmaMetadata {
        nixl_metadata: "b64:eJw=".into(),
        ..sample()
    };
    assert_eq!(
        md.to_json(),
        r#"{"descriptors":[{"device":"cpu","ptr":140234,"size":4096}],"nixl_metadata":"b64:eJw=","notification_key":"0b7c3a43-4a4e-4c43-9a46-8e2c0e0b9a11","operation_kind":1}"#
    );
}

#[test]
fn metadata_round_trips() {
    let md = sample();
    let back = RdmaMetadata::from_json(&md.to_json()).unwrap();
    assert_eq!(back, md);
    assert_eq!(back.decode_nixl_metadata().unwrap(), b"agent-metadata");
}

fn field_of(json: &str) -> &'static str {
    match RdmaMetadata::from_json(json) {
        Err(Error::Metadata { field, .. }) => field,
        other => panic!("expected a metadata error for {json}, got {other:?}"),
    }
}

#[test]
fn metadata_rejects_each_bad_field() {
    let good = sample().to_json();
    let v: serde_json::Value = serde_json::from_str(&good).unwrap();
    let with = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = v.clone();
        f(&mut v);
        v.to_string()
    };
    assert_eq!(field_of("not json"), "json");
    assert_eq!(field_of(&with(&|v| v["extra"] = 1.into())), "(extra key)");
    assert_eq!(
        field_of(&with(&|v| v["descriptors"][0]["ptr"] = 0.into())),
        "descriptors[].ptr"
    );
    assert_eq!(
        field_of(&with(&|v| v["descriptors"][0]["size"] = (-1).into())),
        "descriptors[].size"
    );
    assert_eq!(
        field_of(&with(&|v| v["descriptors"][0]["device"] = "tpu:0".into())),
        "descriptors[].device"
    );
    assert_eq!(
        field_of(&with(&|v| v["descriptors"][0]["bogus"] = 1.into())),
        "(extra key)"
    );
    assert_eq!(
        field_of(&with(&|v| v["operation_kind"] = 0.into())),
        "operation_kind"
    );
    assert_eq!(
        field_of(&with(&|v| v["operation_kind"] = 4.into())),
        "operation_kind"
    );
    assert_eq!(
        field_of(&with(&|v| v["descriptors"] = serde_json::json!([]))),
        "descriptors"
    );
    assert_eq!(
        field_of(&with(&|v| v["notification_key"] = "".into())),
        "notification_key"
    );
    assert_eq!(
        field_of(&with(&|v| v["nixl_metadata"] = "".into())),
        "nixl_metadata"
    );
    let mixed = with(&|v| {
        v["descriptors"] =
            serde_json::json!([{"device":"cpu","ptr":1,"size":1},{"device":"cuda:0","ptr":2,"size":1}])
    });
    assert_eq!(field_of(&mixed), "descriptors");
}

#[test]
fn metadata_mutations_never_panic() {
    let good = sample().to_json().into_bytes();
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let alphabet = b"{}[]\":,0123456789-.eE abcdefghijklmnopqrstuvwxyz_:/+=";
    let mut failures = 0;
    for _ in 0..20_000 {
        let mut m = good.clone();
        for _ in 0..(next() % 4 + 1) {
            let i = (next() as usize) % m.len();
            match next() % 3 {
                0 => m[i] = alphabet[(next() as usize) % alphabet.len()],
                1 => {
                    m.remove(i);
                }
                _ => m.insert(i, alphabet[(next() as usize) % alphabet.len()]),
            }
        }
        let text = String::from_utf8_lossy(&m);
        match RdmaMetadata::from_json(&text) {
            Ok(md) => {
                let _ = md.decode_nixl_metadata();
            }
            Err(Error::Metadata { .. }) => failures += 1,
            Err(other) => panic!("untyped error {other:?} for {text}"),
        }
    }
    assert!(failures > 10_000, "most mutations are rejected: {failures}");
}

#[test]
fn metadata_kind_three_parses_but_is_no_operation() {
    let md = RdmaMetadata {
        operation_kind: 3,
        ..sample()
    };
    let back: RdmaMetadata = serde_json::from_str(&md.to_json()).unwrap();
    assert!(back.kind().is_err());
}
