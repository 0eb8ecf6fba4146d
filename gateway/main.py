"""Entry point of the gateway process (the target of a multiprocessing *spawn* Process).

Boot order:
  1. die with the parent (PR_SET_PDEATHSIG); ignore SIGINT (the supervisor decides when we stop)
  2. bind the configured listeners: REST (uvicorn + Starlette, gateway/http.py) and gRPC
     (grpc.aio, gateway/grpc_service.py), both on one asyncio loop (a port in use: exit 3).
     A ``unix:PATH`` listener is made 0600 from its first moment (our umask), then 0660 and
     owned by ``daemon.shm_group`` when that is set: the file system decides who may call, as
     for the daemon's own frontend. It replaces only a stale socket, never a file or a socket
     somebody still listens on, and is removed at exit.
     With ``token_file``, every call but the health checks needs a token (gateway/access.py);
     with ``tls_cert`` and ``tls_key``, both listeners speak TLS, and with ``tls_client_ca``
     every caller must present a certificate that CA signed. The files are looked at again
     before handshakes (at most once a second, access.TlsFiles): a renewed certificate is in
     use from the next connection on, with no restart.
  3. tell the supervisor on the pipe it gave us, one JSON line: the addresses actually bound
     (``{"http": "127.0.0.1:8000", "grpc": null}``); it marks us READY (supervisor/gatewaykeeper.py)
  4. serve until SIGTERM: stop accepting, finish what is in flight (a few seconds), exit 0

Requests reach the daemon through one native AsyncClient (gateway/service.py). This module
imports only the standard library at module level: the supervisor names ``run`` as the
process's target and must not import uvicorn, grpc or torch to do so.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path

from modelwarden.shared.config import parse_host_port, unix_socket_path
from modelwarden.shared.logs import setup_logging
from modelwarden.shared.states import EXIT_BOOT_ERROR, EXIT_ORPHANED

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 3.0  # in-flight calls finish within this at SIGTERM
BUFFER_TRIM_S = 2.0  # how often idle shared-memory buffers are given back (service.BUFFERS_KEPT)
USAGE_REPORT_S = 1.0  # how often what each caller holds is written for the supervisor to show


def run(spec, pipe) -> None:
    """``spec``: a supervisor.gateway.GatewaySpec; ``pipe``: where we say we are listening."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from modelwarden.shared.process import die_with_parent

    if not die_with_parent(spec.supervisor_pid):
        sys.exit(EXIT_ORPHANED)
    setup_logging("gateway", spec.log_level, spec.log_format)
    _set_title(spec)
    os.umask(0o177)  # the unix sockets we bind start 0600; we create no other file
    # grpc's core logs each failed TLS handshake at INFO on stderr, whoever sends it: a peer
    # could fill the journal. Its errors still reach the log.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
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


def _listening_socket(address: str, group: str | None) -> socket.socket:
    path = unix_socket_path(address)
    if path is not None:
        _claim_unix_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = path
    else:
        host, port = parse_host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
        # TCP, and without it every response waits out the client's delayed ACK (40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT
        where = (host, port)
    try:
        sock.bind(where)
        if path is not None:
            _restrict(path, group)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {address} (http): {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _claim_unix_path(path: str) -> None:
    """Bind only over a stale socket: never over another file, never over a live listener."""
    from modelwarden.shared.process import DaemonError, check_socket_path

    try:
        check_socket_path(Path(path))  # the daemon's own rule for its ipc sockets
    except DaemonError as exc:
        raise OSError(errno.EEXIST, str(exc)) from None
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # nobody listens: a socket left by a process that died
        os.unlink(path)
        return
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on unix:{path}: {exc.strerror}") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"cannot listen on unix:{path}: another process listens there")


def _restrict(path: str, group: str | None) -> None:
    """Without a group the umask made it 0600; with one: owned by that group, then 0660."""
    if not group:
        return
    from modelwarden.shared.process import DaemonError, restrict_socket

    try:
        restrict_socket(Path(path), group)
    except DaemonError as exc:
        raise OSError(errno.EPERM, str(exc)) from None


def _remove_unix_sockets(spec) -> None:
    for address in (spec.http, spec.grpc):
        path = address and unix_socket_path(address)
        try:
            if path and stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(spec, pipe) -> None:
    import uvicorn

    from modelwarden.gateway import grpc_service
    from modelwarden.gateway.http import guarded_protocol, make_app

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # Listeners first: a port in use fails the start in milliseconds, before torch is loaded.
    bound: dict[str, str | None] = {"http": None, "grpc": None}
    sock, grpc_server = None, None
    gate = _gatekeeper(spec)
    if spec.tls_cert:
        _bound_tls_handshakes(spec.read_timeout)
    if spec.http:
        sock = _listening_socket(spec.http, spec.socket_group)
        bound["http"] = (spec.http if sock.family == socket.AF_UNIX
                         else _address(*sock.getsockname()[:2]))
    if spec.grpc:
        grpc_server = grpc_service.make_server(spec.max_message_bytes, spec.max_connections,
                                               spec.read_timeout)
        bound["grpc"] = _bind_grpc(grpc_server, spec.grpc, spec.socket_group,
                                   _grpc_credentials(spec))

    from modelwarden.gateway.service import InferenceService  # imports torch

    service = InferenceService(spec.frontend)
    quotas = _quotas(spec)
    http_server, http_task = None, None
    trimmer = asyncio.create_task(_trim_buffers(service))
    reporter = asyncio.create_task(_report_usage(quotas, spec.usage_file)) if spec.usage_file else None
    try:
        if sock is not None:
            config = uvicorn.Config(
                make_app(service, spec.max_message_bytes, gate, spec.max_json_bytes, quotas),
                http=guarded_protocol(spec.max_connections, spec.read_timeout), lifespan="off",
                log_config=None, access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
            config.load()
            if spec.tls_cert:
                config.ssl = _rotating_context(_tls_files(spec))
            http_server = _uvicorn_server(config)
            http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
            await _started(http_server, http_task)
        if grpc_server is not None:
            grpc_service.add_service(grpc_server, service, gate, quotas)
            await grpc_server.start()
        pipe.send_bytes(json.dumps(bound).encode())
        pipe.close()
        logger.info("gateway serving: %s%s", ", ".join(f"{kind} {address}" for kind, address in
                                                       bound.items() if address),
                    " (TLS)" if spec.tls_cert else "")
        waiters = [asyncio.create_task(stop.wait())] + ([http_task] if http_task else [])
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        logger.info("gateway stopping")
    finally:
        trimmer.cancel()
        if reporter is not None:
            reporter.cancel()
        if http_server is not None:
            http_server.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
        if grpc_server is not None:
            await grpc_server.stop(SHUTDOWN_GRACE_S)
        await service.close()
        _remove_unix_sockets(spec)


def _quotas(spec):
    from modelwarden.gateway.quota import Limits, Quotas

    return Quotas(Limits(spec.max_requests_in_flight, spec.max_bytes_in_flight,
                         spec.identity_share))


async def _trim_buffers(service) -> None:
    """Every BUFFER_TRIM_S, give back the buffers no call used since the last time, and the
    heap's free pages (glibc keeps a burst's freed message bodies, tens of MiB each, in its
    heap otherwise): an idle gateway returns to its working set after a burst."""
    import ctypes

    libc = ctypes.CDLL(None)
    malloc_trim = getattr(libc, "malloc_trim", None)  # glibc's; musl has none
    while True:
        await asyncio.sleep(BUFFER_TRIM_S)
        try:
            given_back = service.trim_buffers()
        except Exception:  # never the end of the gateway: the next turn tries again
            logger.exception("gateway: giving back idle shared-memory buffers failed")
            continue
        if given_back:
            logger.debug("gateway: %d bytes of idle shared-memory buffers given back", given_back)
        if malloc_trim is not None:
            malloc_trim(0)


async def _report_usage(quotas, path: str) -> None:
    """Every USAGE_REPORT_S, what each caller holds (gateway/quota.py), written where the
    supervisor reads it for ``modelwarden status`` and metrics: a file in the daemon's private
    directory (0600, replaced whole by a rename, so a reader never sees half of one)."""
    last = None
    while True:
        usage = quotas.usage()
        if usage != last:
            try:
                _write_private(path, json.dumps(usage).encode())
                last = usage
            except OSError as exc:  # the next turn tries again
                logger.warning("gateway: cannot write %s: %s", path, exc)
        await asyncio.sleep(USAGE_REPORT_S)


def _write_private(path: str, data: bytes) -> None:
    partial = f"{path}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(partial, path)


def _bound_tls_handshakes(seconds: float) -> None:
    """uvicorn passes asyncio no ``ssl_handshake_timeout``, so a peer that opens a TLS connection
    to the REST port and says nothing would hold it for asyncio's default 60 s, uncounted by
    ``max_connections`` (a connection counts once its handshake is done). asyncio reads this
    default at each connection; this process runs no other TLS server."""
    import asyncio.constants

    asyncio.constants.SSL_HANDSHAKE_TIMEOUT = seconds


def _gatekeeper(spec):
    if spec.token_file is None:
        return None
    from modelwarden.gateway.access import Gatekeeper, SecretFileError

    try:
        return Gatekeeper(Path(spec.token_file))
    except SecretFileError as exc:  # it was fine when the daemon started: say what changed
        raise OSError(errno.EACCES, str(exc)) from None


def _tls_files(spec):
    from modelwarden.gateway.access import SecretFileError, TlsFiles

    try:
        return TlsFiles(Path(spec.tls_cert), Path(spec.tls_key),
                        Path(spec.tls_client_ca) if spec.tls_client_ca else None)
    except SecretFileError as exc:  # they were fine when the daemon started: say what changed
        raise OSError(errno.EACCES, str(exc)) from None


def _rotating_context(files):
    """The REST listener's context: each handshake first looks whether the files changed and,
    if they did, goes on with a context made from the new ones (the way servers pick a
    certificate by SNI; Python calls this for every ClientHello, SNI or not)."""
    listening = files.context

    def current_files(ssl_object, server_name, context) -> None:
        files.refresh()
        if files.context is not context:
            ssl_object.context = files.context

    listening.sni_callback = current_files
    return listening


def _grpc_credentials(spec):
    """TLS credentials that grpc asks again before every handshake: a renewed certificate or CA
    is in use from the next connection on."""
    if spec.tls_cert is None:
        return None
    import grpc

    files = _tls_files(spec)

    def configuration():
        key, chain, authority = files.pem
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=authority)

    return grpc.dynamic_ssl_server_credentials(
        configuration(), lambda: configuration() if files.refresh() else None,
        require_client_authentication=spec.tls_client_ca is not None)


def _bind_grpc(server, address: str, group: str | None, credentials) -> str:
    path = unix_socket_path(address)
    if path is not None:
        _claim_unix_path(path)
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as exc:  # recent grpcio raises; older ones return 0
        raise OSError(f"cannot listen on {address} (grpc): {exc}") from None
    if not port:
        raise OSError(f"cannot listen on {address} (grpc)")
    if path is not None:
        _restrict(path, group)
        return address
    return _address(parse_host_port(address)[0], port)


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
