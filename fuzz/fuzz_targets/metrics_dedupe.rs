#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| meshagent::fuzzing::metrics_dedupe(data));
