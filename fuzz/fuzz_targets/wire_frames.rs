//! Fuzz target: `nixl_connect::fuzzing::wire_frames` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    nixl_connect::fuzzing::wire_frames(data);
});
