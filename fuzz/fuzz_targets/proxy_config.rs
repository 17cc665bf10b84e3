#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| meshagent::fuzzing::proxy_config(data));
