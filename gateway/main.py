"""Entry point of the gateway process (the target of a multiprocessing *spawn* Process).

Boot order:
  1. die with the parent (PR_SET_PDEATHSIG); ignore SIGINT (the supervisor decides when we stop)
  2. bind the configured listeners: REST (uvicorn + Starlette, gateway/http.py) and gRPC
     (grpc.aio, gateway/grpc_service.py), both on one asyncio loop (a port in use: exit 3)
  3. tell the supervisor on the pipe it gave us, one JSON line: the addresses actually bound
     (``{"http": "127.0.0.1:8000", "grpc": null}``); it marks us READY (supervisor/gateway.py)
  4. serve until SIGTERM: stop accepting, finish what is in flight (a few seconds), exit 0

Requests reach the daemon through one native AsyncClient (gateway/service.py). This module
imports only the standard library at module level: the supervisor names ``run`` as the
process's target and must not import uvicorn, grpc or torch to do so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys

from modelwarden.shared.config import parse_host_port
from modelwarden.shared.logs import setup_logging
from modelwarden.shared.states import EXIT_BOOT_ERROR, EXIT_ORPHANED

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 3.0  # in-flight calls finish within this at SIGTERM


def run(spec, pipe) -> None:
    """``spec``: a supervisor.gateway.GatewaySpec; ``pipe``: where we say we are listening."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from modelwarden.worker.placement import die_with_parent

    if not die_with_parent(spec.supervisor_pid):
        sys.exit(EXIT_ORPHANED)
    setup_logging("gateway", spec.log_level, spec.log_format)
    _set_title(spec)
    try:
        asyncio.run(_serve(spec, pipe))
    except OSError as exc:  # a listener could not bind
        logger.error("gateway: %s", exc)
        sys.exit(EXIT_BOOT_ERROR)
    sys.exit(0)


def _set_title(spec) -> None:
    try:
        import setproctitle

        listeners = " ".join(f"{kind} {address}" for kind, address in
                             (("http", spec.http), ("grpc", spec.grpc)) if address)
        setproctitle.setproctitle(f"modelwarden: gateway {listeners}")
    except ImportError:
        pass


def _listening_socket(address: str) -> socket.socket:
    host, port = parse_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it every response waits out the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {address} (http): {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(spec, pipe) -> None:
    import uvicorn

    from modelwarden.gateway import grpc_service
    from modelwarden.gateway.http import make_app

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # Listeners first: a port in use fails the start in milliseconds, before torch is loaded.
    bound: dict[str, str | None] = {"http": None, "grpc": None}
    sock, grpc_server = None, None
    if spec.http:
        sock = _listening_socket(spec.http)
        bound["http"] = _address(*sock.getsockname()[:2])
    if spec.grpc:
        grpc_server = grpc_service.make_server(spec.max_message_bytes)
        bound["grpc"] = _bind_grpc(grpc_server, spec.grpc)

    from modelwarden.gateway.service import InferenceService  # imports torch

    service = InferenceService(spec.frontend)
    http_server, http_task = None, None
    try:
        if sock is not None:
            http_server = _uvicorn_server(uvicorn.Config(
                make_app(service, spec.max_message_bytes), http=_http_protocol(), lifespan="off",
                log_config=None, access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
            http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
            await _started(http_server, http_task)
        if grpc_server is not None:
            grpc_service.add_service(grpc_server, service)
            await grpc_server.start()
        pipe.send_bytes(json.dumps(bound).encode())
        pipe.close()
        logger.info("gateway serving: %s", ", ".join(f"{kind} {address}" for kind, address in
                                                     bound.items() if address))
        waiters = [asyncio.create_task(stop.wait())] + ([http_task] if http_task else [])
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        logger.info("gateway stopping")
    finally:
        if http_server is not None:
            http_server.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
        if grpc_server is not None:
            await grpc_server.stop(SHUTDOWN_GRACE_S)
        await service.close()


def _bind_grpc(server, address: str) -> str:
    host, _ = parse_host_port(address)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # recent grpcio raises; older ones return 0
        raise OSError(f"cannot listen on {address} (grpc): {exc}") from None
    if not port:
        raise OSError(f"cannot listen on {address} (grpc)")
    return _address(host, port)


def _http_protocol() -> str:
    """httptools (the faster parser) when it is installed, else h11."""
    import importlib.util

    return "httptools" if importlib.util.find_spec("httptools") else "h11"


async def _started(server, task: asyncio.Task) -> None:
    """uvicorn says it started by a flag: look at it each loop turn until it does (or fails)."""
    while not server.started:
        if task.done():
            task.result()
            raise OSError("the HTTP server stopped while starting")
        await asyncio.sleep(0.005)


def _uvicorn_server(config):
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        # SIGTERM is ours (the loop's handler in _serve): uvicorn must not take it over, nor
        # raise it again after its shutdown.
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)
