//! Fuzz target: `nixl_connect::fuzzing::metadata_json` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    nixl_connect::fuzzing::metadata_json(data);
});
