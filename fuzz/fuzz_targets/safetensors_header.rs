//! The safetensors header reader must return Ok or a typed error for any bytes: no panic, no unbounded
//! allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = verity::bundle::safetensors::parse_header(std::path::Path::new("fuzz.safetensors"), data);
});
