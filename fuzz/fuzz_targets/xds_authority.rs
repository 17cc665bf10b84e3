#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| meshagent::fuzzing::xds_authority(data));
