;; A minimal proxy-wasm (ABI 0.2.1) HTTP filter: every response gets
;; `x-wasm-meshagent: loaded`. Assembled by the tests with wabt's wat2wasm.
(module
  (import "env" "proxy_add_header_map_value"
    (func $add_header (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 17)
  ;; Bump allocator above the static data; Envoy only allocates for small host buffers.
  (global $heap (mut i32) (i32.const 65536))
  (data (i32.const 16) "x-wasm-meshagent")
  (data (i32.const 64) "loaded")
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap
      (i32.and (i32.add (i32.add (global.get $heap) (local.get $size)) (i32.const 7))
               (i32.const -8)))
    (local.get $p))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_delete") (param i32))
  ;; map type 2 = response headers; action 0 = Continue.
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
    (drop (call $add_header (i32.const 2) (i32.const 16) (i32.const 16) (i32.const 64) (i32.const 6)))
    (i32.const 0)))
