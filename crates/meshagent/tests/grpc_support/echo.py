"""Proxyless gRPC peers for tests/grpc_proxyless.rs, on grpcio (C-core's xDS client).

  echo.py xds-server NAME PORT     an xDS server (GRPC_XDS_BOOTSTRAP), xds_server_credentials
  echo.py plain-server NAME:PORT…  plain gRPC servers (endpoints reached through xDS config)
  echo.py client TARGET…           one long-lived channel per target, xds_channel_credentials,
                                   calling every 200 ms and printing one line per call

The method is /echo.Echo/Call on raw bytes; the reply names the server and the caller's SPIFFE
identity as the server's TLS stack saw it ("peer=none" over plaintext).
"""
import sys
import threading
import time
from concurrent import futures

import grpc
import grpc.experimental


def handler(name):
    def call(request, context):
        peer = "none"
        for values in context.auth_context().values():
            for v in values:
                if v.startswith(b"spiffe://"):
                    peer = v.decode()
        return f"{name} peer={peer}".encode()

    return grpc.method_handlers_generic_handler(
        "echo.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )


def serve_forever(servers):
    for s in servers:
        s.start()
    print("SERVING", flush=True)
    while True:
        time.sleep(3600)


def main():
    mode = sys.argv[1]
    if mode == "xds-server":
        name, port = sys.argv[2], sys.argv[3]
        s = grpc.server(futures.ThreadPoolExecutor(max_workers=4), xds=True)
        s.add_generic_rpc_handlers((handler(name),))
        creds = grpc.xds_server_credentials(grpc.insecure_server_credentials())
        s.add_secure_port(f"127.0.0.1:{port}", creds)
        serve_forever([s])
    elif mode == "plain-server":
        servers = []
        for spec in sys.argv[2:]:
            name, port = spec.split(":")
            s = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            s.add_generic_rpc_handlers((handler(name),))
            s.add_insecure_port(f"127.0.0.1:{port}")
            servers.append(s)
        serve_forever(servers)
    elif mode == "client":
        creds = grpc.xds_channel_credentials(grpc.experimental.insecure_channel_credentials())
        lock = threading.Lock()

        def loop(target):
            channel = grpc.secure_channel(f"xds:///{target}", creds)
            call = channel.unary_unary("/echo.Echo/Call")
            while True:
                try:
                    reply = call(b"hi", timeout=3).decode()
                    line = f"{target} OK {reply}"
                except grpc.RpcError as e:
                    line = f"{target} ERR {e.code().name} {e.details()}"
                with lock:
                    print(line, flush=True)
                time.sleep(0.2)

        threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t in sys.argv[2:]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
