//! The GGUF header parser must return Ok or a typed error for any bytes: no panic, no unbounded allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = verity::bundle::gguf::parse_header(std::path::Path::new("fuzz.gguf"), data);
});
