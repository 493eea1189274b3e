#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath_wire::websocket::fuzz_check(data));
