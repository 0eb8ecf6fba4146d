"""HAProxy (Debian's package) in TCP mode, health-checked on the gateways' /v2/health/ready, in
front of two daemons' KServe v2 gateways: tritonclient through it keeps working while one daemon
is SIGKILLed and restarted. Every failure the client meets is either retried under the policy of
docs/SCALING.md ("Retry policy for clients behind a load balancer") or counted as a failure; the
test wants 0 failures.

tritonclient's HTTP transport (geventhttpclient) itself re-sends a request whose keep-alive
connection closed before the response; what it does not absorb reaches RetryingClient, whose
retries are printed (``-s``).

The balancer passes the byte stream through untouched (mode tcp): TLS or CURVE would go through
the same way.

The same with gRPC: HAProxy in HTTP mode speaking HTTP/2 (h2c) on both sides balances each
gRPC call on its own, health-checked on the same REST endpoint; tritonclient.grpc through it,
with the gRPC rows of the same retry policy (RetryingGrpcClient).

Skips without the haproxy binary (apt-get install haproxy) or the gateway extras."""

from __future__ import annotations

import csv
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("uvicorn", reason="the gateway extra is not installed: pip install '.[gateway]'")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient is in the gateway-test extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient is in the gateway-test extra")
from geventhttpclient.response import HTTPConnectionClosed  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.faulty import reference  # noqa: E402
from tests.fleet import MODEL, fleet_model, served  # noqa: E402
from tests.helpers import poll_until  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.test_gateway import gateway_daemon  # noqa: E402

HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="no haproxy binary: apt-get install -y haproxy")

PREAMBLE = """\
global
    maxconn 512
    stats socket {stats} mode 600 level user
defaults
    mode MODE
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch
"""

CONFIG = PREAMBLE.replace("MODE", "tcp") + """\
frontend fleet
    bind 127.0.0.1:{front}
    default_backend gateways
backend gateways
    balance leastconn
    option httpchk GET /v2/health/ready
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2 on-marked-down shutdown-sessions
    server first 127.0.0.1:{first} check
    server second 127.0.0.1:{second} check
"""

# gRPC: HTTP mode, HTTP/2 without TLS (h2c) to the clients and to the gateways, so each call is
# balanced on its own; the health check stays HTTP/1.1 GET /v2/health/ready on the REST port.
CONFIG_GRPC = PREAMBLE.replace("MODE", "http") + """\
frontend fleet
    bind 127.0.0.1:{front} proto h2
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /v2/health/ready
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2 on-marked-down shutdown-sessions
    server first 127.0.0.1:{first} proto h2 check port {first_http} check-proto h1
    server second 127.0.0.1:{second} proto h2 check port {second_http} check-proto h1
"""


def gateway_fleet_daemon(port: int, grpc_port: int | None = None):
    model = fleet_model(outputs=[{"name": "y", "dtype": "float32", "shape": [-1, 8]}])
    listeners = {"http": f"127.0.0.1:{port}"}
    if grpc_port is not None:
        listeners["grpc"] = f"127.0.0.1:{grpc_port}"
    daemon = gateway_daemon([model], listeners)
    daemon.http_port, daemon.grpc_port = port, grpc_port
    return daemon


# How long the retry of a call that may have run waits: HAProxy marks a dead gateway DOWN within
# fall x inter (2 x 200 ms in the configs below).
MARKED_DOWN_S = 0.5


class Retrying:
    """What both transports' retrying clients share: a tritonclient made by ``connect``, the
    retries counted by kind, and the policy's back-off."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = self.connect()
        self.retried: dict[str, int] = {}
        self._backoff = threading.Event()  # never set: a wait with a timeout

    def connect(self):
        raise NotImplementedError

    def reconnect(self) -> None:
        try:
            self.client.close()
        except Exception:  # a broken connection may fail to close: it is gone either way
            pass
        self.client = self.connect()

    def back_off(self, not_run: int, cut_off: bool = False) -> None:
        """``cut_off``: the call just failed after it was sent (it may have run)."""
        if cut_off:
            # A call cut off by a dying daemon: its retry waits out the health check (fall 2 x
            # inter 200ms). At once, round robin may send it to the same daemon, whose
            # listening socket still takes connections while the kernel tears the process down,
            # and then resets them: a second "may have run", which the policy does not retry.
            self._backoff.wait(MARKED_DOWN_S)
        elif not_run > 1:  # the first retry at once, then exponential back-off
            self._backoff.wait(min(2.0, 0.1 * 2 ** (not_run - 2)))

    def _note(self, kind: str) -> None:
        self.retried[kind] = self.retried.get(kind, 0) + 1


class RetryingClient(Retrying):
    """tritonclient over HTTP with the retry policy of docs/SCALING.md: a 503 or a refused
    connection (it did not run) is retried with back-off, up to 5 times; a connection that broke
    after the request was sent (it may have run) is retried once, on a new connection. Anything
    else is a failure."""

    def connect(self):
        return httpclient.InferenceServerClient(self.url, connection_timeout=5, network_timeout=30)

    def infer(self, x: np.ndarray) -> np.ndarray:
        not_run, may_have_run = 0, 0
        while True:
            cut_off = False
            try:
                item = httpclient.InferInput("x", list(x.shape), "FP32")
                item.set_data_from_numpy(x, binary_data=True)
                return self.client.infer(MODEL, [item]).as_numpy("y")
            except InferenceServerException as exc:
                if exc.status() != "503" or not_run == 5:
                    raise
                not_run += 1
                self._note(f"503 {exc.message()[:40]}")
            except ConnectionRefusedError:
                if not_run == 5:
                    raise
                not_run += 1
                self._note("refused")
            except (OSError, EOFError, HTTPConnectionClosed) as exc:  # reset, closed: it may have run
                if may_have_run == 1:
                    raise
                may_have_run += 1
                cut_off = True
                self._note(type(exc).__name__)
            self.back_off(not_run, cut_off)
            self.reconnect()


NOT_RUN = ("OVERLOADED", "NO_WORKER", "SHUTTING_DOWN")  # a gateway's UNAVAILABLE: it did not run


class RetryingGrpcClient(Retrying):
    """tritonclient over gRPC with the gRPC rows of docs/SCALING.md's policy: UNAVAILABLE from a
    gateway (OVERLOADED, NO_WORKER, SHUTTING_DOWN: it did not run) is retried with back-off, up
    to 5 times; any other UNAVAILABLE (HAProxy's 502 or a reset: the call may have run) once.
    Anything else is a failure."""

    def connect(self):
        return grpcclient.InferenceServerClient(self.url)

    def infer(self, x: np.ndarray) -> np.ndarray:
        not_run, may_have_run = 0, 0
        while True:
            cut_off = False
            try:
                item = grpcclient.InferInput("x", list(x.shape), "FP32")
                item.set_data_from_numpy(x)
                return self.client.infer(MODEL, [item], client_timeout=30).as_numpy("y")
            except InferenceServerException as exc:
                if exc.status() != "StatusCode.UNAVAILABLE":
                    raise
                if any(code in exc.message() for code in NOT_RUN):
                    if not_run == 5:
                        raise
                    not_run += 1
                    self._note(f"UNAVAILABLE {exc.message()[:30]}")
                else:
                    if may_have_run == 1:
                        raise
                    may_have_run += 1
                    cut_off = True
                    self._note(f"UNAVAILABLE {exc.message()[:60]}")
            self.back_off(not_run, cut_off)


class TritonLoad:
    """``threads`` threads, each with its own retrying client (a new connection every 25
    requests, so a restarted backend gets connections again), until stopped."""

    def __init__(self, url: str, threads: int = 4, client=RetryingClient) -> None:
        self.url = url
        self.make_client = client
        self.ok = 0
        self.failures: list[str] = []
        self.retried: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed,), daemon=True)
                         for seed in range(threads)]

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        client = self.make_client(self.url)
        count = 0
        while not self._stop.is_set():
            x = rng.standard_normal((4, 8), dtype=np.float32)
            try:
                y = client.infer(x)
                good = np.allclose(y, reference(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5)
                outcome = None if good else "wrong result"
            except Exception as exc:  # every failure the policy does not cover counts
                outcome = repr(exc)[:200]
            with self._lock:
                if outcome is None:
                    self.ok += 1
                else:
                    self.failures.append(outcome)
            count += 1
            if count % 25 == 0:
                client.reconnect()
        with self._lock:
            for kind, times in client.retried.items():
                self.retried[kind] = self.retried.get(kind, 0) + times

    def __enter__(self) -> "TritonLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
            assert not thread.is_alive(), "a load thread hangs"


@pytest.fixture
def balanced(tmp_path: Path):
    daemons = [gateway_fleet_daemon(free_port()) for _ in range(2)]
    yield from running_behind_haproxy(tmp_path, daemons, CONFIG, first=daemons[0].http_port,
                                      second=daemons[1].http_port)


@pytest.fixture
def balanced_grpc(tmp_path: Path):
    daemons = [gateway_fleet_daemon(free_port(), free_port()) for _ in range(2)]
    yield from running_behind_haproxy(tmp_path, daemons, CONFIG_GRPC, first=daemons[0].grpc_port,
                                      second=daemons[1].grpc_port, first_http=daemons[0].http_port,
                                      second_http=daemons[1].http_port)


def running_behind_haproxy(tmp_path: Path, daemons: list, template: str, **ports):
    front = free_port()
    config = tmp_path / "haproxy.cfg"
    stats = tmp_path / "stats.sock"
    config.write_text(template.format(front=front, stats=stats, **ports))
    check = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proxy = None
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        proxy = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        yield daemons, f"127.0.0.1:{front}", stats
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        for daemon in daemons:
            daemon.cleanup()


def server_status(stats: Path, server: str) -> str:
    """HAProxy's view of a backend server (UP, DOWN, ...), from its stats socket."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(5)
        connection.connect(str(stats))
        connection.sendall(b"show stat\n")
        text = b"".join(iter(lambda: connection.recv(65536), b"")).decode()
    rows = list(csv.reader(text.lstrip("# ").splitlines()))
    header = rows[0]
    for row in rows[1:]:
        if len(row) == len(header) and row[header.index("svname")] == server:
            return row[header.index("status")]
    raise AssertionError(f"no server {server} in HAProxy's stats")


def ready_through(url: str) -> bool:
    try:
        return httpclient.InferenceServerClient(url, connection_timeout=2).is_server_ready()
    except Exception:
        return False


def test_tritonclient_through_haproxy_survives_a_killed_and_restarted_daemon(balanced):
    (first, second), url, stats = balanced
    poll_until(lambda: ready_through(url), 60, message="the gateways ready through HAProxy")
    kill_and_restart_behind_haproxy(first, second, stats, TritonLoad(url))


def test_grpc_through_haproxy_is_balanced_per_call_and_survives_a_killed_and_restarted_daemon(
        balanced_grpc):
    (first, second), url, stats = balanced_grpc
    poll_until(lambda: ready_through_grpc(url), 60, message="the gateways ready through HAProxy")
    # One channel, one HTTP/2 connection to HAProxy: its calls still reach both daemons.
    client = RetryingGrpcClient(url)
    before = served(first), served(second)
    x = np.ones((4, 8), dtype=np.float32)
    for _ in range(20):
        np.testing.assert_allclose(client.infer(x), reference(torch.from_numpy(x)).numpy(),
                                   rtol=1e-4, atol=1e-5)
    assert served(first) > before[0] and served(second) > before[1]
    client.client.close()
    kill_and_restart_behind_haproxy(first, second, stats, TritonLoad(url, client=RetryingGrpcClient))


def ready_through_grpc(url: str) -> bool:
    try:
        return grpcclient.InferenceServerClient(url).is_server_ready()
    except Exception:
        return False


def kill_and_restart_behind_haproxy(first, second, stats: Path, load: TritonLoad) -> None:
    poll_until(lambda: server_status(stats, "first") == server_status(stats, "second") == "UP", 30,
               message="HAProxy's health checks passing on both gateways")
    with load:
        poll_until(lambda: served(first) >= 20 and served(second) >= 20, 60,
                   message="both daemons serving through HAProxy")
        poll_until(lambda: first.status()["daemon"]["pending"] > 0, 30,
                   message="the daemon to kill holding requests")
        first.process.kill()
        first.process.wait(30)
        poll_until(lambda: server_status(stats, "first") == "DOWN", 10,
                   message="HAProxy's health check marking the killed daemon DOWN")
        after_kill = served(second)
        poll_until(lambda: served(second) >= after_kill + 100, 60,
                   message="the other daemon taking the whole load")
        first.start()
        first.wait_ready()
        poll_until(lambda: server_status(stats, "first") == "UP", 60,
                   message="HAProxy's health check marking the restarted daemon UP")
        poll_until(lambda: served(first) >= 20, 90, message="the restarted daemon serving again")
    assert load.failures == [], (load.failures[:5], load.retried)
    assert load.ok > 200, load.ok
    print(f"ok={load.ok} retried={load.retried}")
