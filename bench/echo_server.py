"""The transport baseline for the kvstore benchmark: a bare ``grpc.aio`` echo server.

One generic handler, ``/tandem.bench.Echo/Echo``, with identity (bytes) serializers: no protobuf,
no interceptors, no health service; the handler returns the request bytes. Whatever a kvstore RPC
costs above this is the kvstore's own work (protobuf, servicer, core).

Run as a separate process; it prints ``PORT <n>`` on stdout once bound and serves until
SIGTERM/SIGINT::

    python bench/echo_server.py [--port 0] [--host 127.0.0.1] [--tls-cert C --tls-key K --tls-ca CA]

With the ``--tls-*`` files it serves mutual TLS (client certificates required), the transport
baseline of ``kvstore_bench.py --tls``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc

SERVICE = "tandem.bench.Echo"
METHOD = f"/{SERVICE}/Echo"


def _identity(b: bytes) -> bytes:
    return b


async def _echo(request: bytes, context) -> bytes:
    return request


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {"Echo": grpc.unary_unary_rpc_method_handler(_echo, _identity, _identity)},
    )


async def serve(host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> None:
    """Serve until SIGTERM/SIGINT. Prints the bound port on stdout."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_handler(),))
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    print(f"PORT {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    parser.add_argument("--tls-ca", default="")
    args = parser.parse_args(argv)
    credentials = None
    if args.tls_cert:
        with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k, open(args.tls_ca, "rb") as ca:
            credentials = grpc.ssl_server_credentials([(k.read(), c.read())], root_certificates=ca.read(),
                                                      require_client_auth=True)
    asyncio.run(serve(args.host, args.port, credentials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
