#![no_main]

// The property lives in `meshagent::fuzzing::nft_render` (also replayed by
// `crates/meshagent/tests/fuzz_corpus.rs`); `nft -c` runs when root and nft are present.
libfuzzer_sys::fuzz_target!(|data: &[u8]| meshagent::fuzzing::nft_render(data));
