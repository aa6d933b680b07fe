//! Fuzz target: `nixl_connect::fuzzing::link_sequences`: programs of honest, forged, replayed,
//! truncated and raw frames into a connected pair of same-host protocol cores (both roles).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    nixl_connect::fuzzing::link_sequences(data);
});
