#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::canon::fuzz_check(data));
