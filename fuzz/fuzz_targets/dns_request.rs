#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| meshagent::fuzzing::dns_request(data));
