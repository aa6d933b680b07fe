//! Fuzz target: `nixl_connect::fuzzing::agent_metadata` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    nixl_connect::fuzzing::agent_metadata(data);
});
