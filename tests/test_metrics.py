"""``[daemon] metrics``: Prometheus text, /healthz and /readyz, scraped over loopback from the real
daemon and parsed with prometheus_client's own parser."""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelwarden.client.client import BadInput, Client, ModelError, UnknownModel
from modelwarden.shared.config import ConfigError, load_settings
from tests.faulty import MARKER
from modelwarden.shared import protocol
from modelwarden.supervisor import metrics_http
from modelwarden.supervisor.metrics_http import (Admission, BadRequest, HttpServer, RefusalLog,
                                                 Response, parse_head)
from modelwarden.supervisor.timers import Timers
from tests.helpers import Daemon, faulty_model, fd_count, poll_until, raw_request

QUICK = {"start_seconds": 0.5, "backoff_initial": 0.1, "kill_grace": 1.0}


def echo(name: str, workers: int = 2, **extra) -> dict:
    model = {"name": name, "source": "python:tests.faulty:make_echo", "kwargs": {"copy": True},
             "workers": workers, "warmup": 0, "cores_per_worker": 1,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}], **QUICK}
    model.update(extra)
    return model


def metrics_url(daemon: Daemon) -> str:
    """The daemon binds port 0 and logs the port it got: no port can be taken by another test."""
    found = poll_until(lambda: re.search(r"metrics on (http://\S+)/metrics", daemon.log())
                       or daemon.check_running(), 30, message="the metrics line in the log")
    return found.group(1)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(base: str) -> dict:
    """{(sample name, frozenset of labels): value} for every sample."""
    code, text = get(base + "/metrics")
    assert code == 200, text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    """The sample with exactly these labels; for the request counter, which also has a
    ``version`` label, the sum over the versions when the test names none."""
    exact = samples.get((name, frozenset(labels.items())))
    if exact is not None or name != "modelwarden_requests_total" or "version" in labels:
        return exact
    matching = [v for (sample, found), v in samples.items()
                if sample == name and set(labels.items()) <= found]
    return sum(matching) if matching else None


def test_metrics_follow_requests_errors_and_a_killed_worker():
    with Daemon([echo("echo")], daemon={"metrics": "127.0.0.1:0"}) as daemon:
        base = metrics_url(daemon)
        # The server binds before any worker is spawned; a worker needs seconds to import torch.
        assert get(base + "/readyz")[0] == 503
        assert get(base + "/healthz") == (200, "loop running\n")
        daemon.wait_ready()
        poll_until(lambda: get(base + "/readyz")[0] == 200, 10, message="/readyz 200 once READY")

        x = np.ones((3, 4), np.float32)
        with Client(daemon.endpoint, timeout=10) as client:
            for _ in range(3):
                client.infer("echo", {"x": x})
            # What each identity holds: this client's connection, counted against our uid.
            me = f"uid:{os.geteuid()}"
            poll_until(lambda: (value(scrape(base), "modelwarden_identity_held", identity=me,
                                      resource="connections") or 0) >= 1, 5,
                       message="the client's connection shown under its identity")
            with pytest.raises(BadInput):
                client.infer("echo", {"x": np.ones((3, 4), np.int64)})
            with pytest.raises(UnknownModel):
                client.infer("no-such-model", {"x": x})
        # Counters reach the scrape at the loop's next tick (0.1 s).
        samples = poll_until(lambda: (lambda found: value(found, "modelwarden_requests_total", model="echo",
                                                          code="ok") == 3
                                      and value(found, "modelwarden_requests_total", model="-",
                                                code="UNKNOWN_MODEL") == 1 and found)(scrape(base)),
                             5, message="every answer counted")
        assert value(samples, "modelwarden_requests_total", model="echo", code="ok") == 3
        version = next(model["version"] for model in daemon.status()["models"])
        assert value(samples, "modelwarden_requests_total", model="echo", version=version,
                     code="ok") == 3  # answers are counted by the version that computed them
        assert value(samples, "modelwarden_requests_total", model="echo", code="BAD_INPUT") == 1
        # A name the client made up never becomes a label.
        assert value(samples, "modelwarden_requests_total", model="-", code="UNKNOWN_MODEL") == 1
        for histogram in ("modelwarden_request_seconds", "modelwarden_queue_seconds",
                          "modelwarden_compute_seconds", "modelwarden_batch_size"):
            assert value(samples, histogram + "_count", model="echo") == 3, histogram
        assert value(samples, "modelwarden_batch_size_sum", model="echo") == 3
        assert value(samples, "modelwarden_workers", model="echo", state="READY") == 2
        assert value(samples, "modelwarden_fatal_slots", model="echo") == 0
        assert value(samples, "modelwarden_queue_depth", model="echo") == 0
        poll_until(lambda: len([key for key in scrape(base) if key[0] == "modelwarden_worker_rss_bytes"]) == 2,
                   10, message="an RSS sample for each worker")

        victim = daemon.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        poll_until(lambda: value(scrape(base), "modelwarden_restarts_total", model="echo",
                                 cause="SIGKILL") == 1, 15, message="the restart counted by cause")
        poll_until(lambda: get(base + "/readyz")[0] == 200
                   and value(scrape(base), "modelwarden_workers", model="echo", state="READY") == 2,
                   60, message="ready again once the replacement is READY")
        samples = scrape(base)
        assert value(samples, "modelwarden_restarts_total", model="echo", cause="SIGKILL") == 1
        assert value(samples, "modelwarden_requests_total", model="echo", code="ok") == 3
        assert daemon.stop() == 0


def test_failed_probes_are_counted_across_workers():
    # Every probe's output leaves the declared range; 1000 failures in a row to be replaced.
    probe = {"interval": 0.1, "range": [1000.0, 2000.0], "failures": 1000}
    with Daemon([echo("probed", workers=1, probe=probe)], daemon={"metrics": "127.0.0.1:0"}) as daemon:
        base = metrics_url(daemon)
        daemon.wait_ready()
        poll_until(lambda: (value(scrape(base), "modelwarden_probe_failures_total", model="probed")
                            or 0) >= 3, 30, message="three failed probes counted")
        assert daemon.stop() == 0


def test_fatal_slots_show_and_keep_the_daemon_unready():
    bad = faulty_model("bad", "load_error", max_start_failures=1, **QUICK)
    with Daemon([echo("good", workers=1), bad], daemon={"metrics": "127.0.0.1:0"}) as daemon:
        base = metrics_url(daemon)
        poll_until(lambda: value(scrape(base), "modelwarden_fatal_slots", model="bad") == 1, 60,
                   message="bad#0 FATAL in the metrics")
        daemon.wait_ready(models=["good"])
        samples = scrape(base)
        assert value(samples, "modelwarden_slots", model="bad", state="FATAL") == 1
        assert value(samples, "modelwarden_ready", ) == 0
        assert get(base + "/readyz")[0] == 503
        assert get(base + "/healthz")[0] == 200
        assert daemon.stop() == 0


@pytest.mark.parametrize("address, problem", [
    ("0.0.0.0:9464", "reachable from other hosts"),
    ("localhost", "is not HOST:PORT"),
    (":9464", "names no host"),
])
def test_a_bad_or_public_metrics_address_is_a_config_error(tmp_path, address, problem):
    path = tmp_path / "modelwarden.toml"
    path.write_text(f'[daemon]\nmetrics = "{address}"\n')
    with pytest.raises(ConfigError, match=problem):
        load_settings(path)


def test_a_public_metrics_address_is_allowed_when_said(tmp_path):
    path = tmp_path / "modelwarden.toml"
    path.write_text('[daemon]\nmetrics = "0.0.0.0:9464"\nallow_public_metrics = true\n')
    assert load_settings(path).daemon.metrics == "0.0.0.0:9464"


ACCESS_LINE = re.compile(r"rid=(\S+) id=(\S+) model=(\S+) worker=(\S+) code=(\S+) queue_us=(\S+) "
                         r"compute_us=(\S+) total_us=(\S+) batch=(\S+)$", re.MULTILINE)


def test_the_access_log_has_a_line_per_answer_ok_or_error():
    with Daemon([faulty_model("raises", "raise")],
                daemon={"access_log": True, "log_level": "WARNING"}) as daemon:
        daemon.wait_ready()
        x = np.ones((2, 8), np.float32)
        with Client(daemon.endpoint, timeout=10) as client:
            client.infer("raises", {"x": x})
            with pytest.raises(ModelError):
                client.infer("raises", {"x": np.full((2, 8), MARKER, np.float32)})
            with pytest.raises(BadInput):
                client.infer("raises", {"x": x.astype(np.int64)})
        lines = poll_until(lambda: len(ACCESS_LINE.findall(daemon.log())) == 3
                           and ACCESS_LINE.findall(daemon.log()), 10, message="three access lines")
        ok, failed, refused = lines
        assert ok[2:5] == ("raises", "raises#0", "ok") and ok[8] == "1", ok
        assert ok[0].isdigit() and ok[1].isdigit() and all(part.isdigit() for part in ok[5:8]), ok
        # The worker's own error code, read from the reply it wrote.
        assert failed[2:5] == ("raises", "raises#0", "MODEL_ERROR"), failed
        assert failed[0].isdigit() and failed[5].isdigit() and failed[6] == "-", failed
        # Refused at intake: no supervisor rid, no worker, nothing queued or computed.
        assert refused[0] == "-" and refused[2:5] == ("raises", "-", "BAD_INPUT"), refused
        assert refused[5:7] == ("-", "-") and refused[7].isdigit(), refused
        assert daemon.stop() == 0


def test_a_client_chosen_id_cannot_forge_an_access_log_line():
    forged = "x\nrid=99 id=1 model=raises worker=raises#0 code=ok queue_us=1 compute_us=1"
    with Daemon([faulty_model("raises", "raise")], daemon={"access_log": True}) as daemon:
        daemon.wait_ready()
        header = {"type": "infer", "id": forged, "model": "raises", "inputs": 0,
                  "tensors": [{"dtype": "float32", "shape": [2, 8], "frame": 0}]}
        reply = raw_request(daemon.endpoint, [protocol.SIGNATURE, protocol.pack(header),
                                              np.ones((2, 8), np.float32).tobytes()])
        assert reply["ok"] and reply["id"] == forged
        # the id as a quoted literal, its newline escaped: one line, no forged second one
        poll_until(lambda: f"id={forged!r} model=raises" in daemon.log(), 10,
                   message="the access line with the escaped id")
        assert not re.search(r"^rid=99 ", daemon.log(), re.MULTILINE)


def test_no_access_log_unless_asked():
    with Daemon([echo("echo", workers=1)]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=10) as client:
            client.infer("echo", {"x": np.ones((2, 4), np.float32)})
        assert daemon.stop() == 0
        assert "INFO" in daemon.log() and not ACCESS_LINE.search(daemon.log())


def test_histogram_buckets_are_cumulative_and_inclusive():
    """The loop's own counts, exposed through prometheus_client and read back by its parser."""
    from prometheus_client import CollectorRegistry, generate_latest

    from modelwarden.supervisor.metrics import Telemetry

    class Answered:
        model = "m"

    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    for total_us in (100, 101, 2_000_000, 60_000_000):  # 0.1 ms is its bucket's upper bound
        telemetry.requests.answered(Answered(), "ok", {"queue_us": 0, "compute_us": None,
                                                       "total_us": total_us, "batch": 3})
    telemetry.publish({}, lambda pool: 0)
    samples = {(s.name, frozenset(s.labels.items())): s.value for family in
               text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    bucket = lambda le: value(samples, "modelwarden_request_seconds_bucket", model="m", le=le)
    assert (bucket("0.0001"), bucket("0.00025"), bucket("2.5"), bucket("30.0"), bucket("+Inf")) == (1, 2, 3, 3, 4)
    assert value(samples, "modelwarden_request_seconds_sum", model="m") == pytest.approx(62.000201)
    assert value(samples, "modelwarden_compute_seconds_count", model="m") == 0
    assert (value(samples, "modelwarden_batch_size_bucket", model="m", le="2.0"),
            value(samples, "modelwarden_batch_size_bucket", model="m", le="4.0")) == (0, 4)
    assert value(samples, "modelwarden_requests_total", model="m", code="ok") == 4


# -- the loop's HTTP server: policy with an injected clock, sockets with a fake loop ---------------


def test_a_request_head_is_parsed_only_whole_and_bounded():
    assert parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n") is None  # not whole yet
    request = parse_head(b"GET /metrics?name[]=a HTTP/1.1\r\nAccept: text/plain\r\n\r\n")
    assert (request.method, request.path, request.query, request.headers) == (
        "GET", "/metrics", {"name[]": ["a"]}, {"accept": "text/plain"})
    for garbage in (b"\x16\x03\x01 hello\r\n\r\n", b"GET /\r\n\r\n", b"GET / HTTP/1.0\r\nno colon\r\n\r\n"):
        with pytest.raises(BadRequest) as refused:
            parse_head(garbage)
        assert refused.value.status == 400, garbage
    with pytest.raises(BadRequest) as refused:  # no end in sight after the limit
        parse_head(b"GET / HTTP/1.0\r\nX: " + b"a" * metrics_http.HEAD_LIMIT)
    assert refused.value.status == 431


def test_admission_caps_connections_in_all_and_per_source():
    admission = Admission(max_connections=4, per_source=2)
    for source in ("a", "a", "b"):
        assert admission.refusal(source) is None
        admission.opened(source)
    assert admission.refusal("a") == "source"  # a's share is taken; b and c still have room
    assert admission.refusal("b") is None
    admission.opened("c")
    assert admission.refusal("d") == "full"
    admission.closed("a")
    assert admission.refusal("a") is None and admission.by_source == {"a": 1, "b": 1, "c": 1}


def test_refusals_are_logged_once_a_minute_per_source_with_a_count():
    now = [100.0]
    log = RefusalLog(lambda: now[0])
    first = log.note("127.0.0.2", "full")
    assert first is not None and "127.0.0.2" in first and "1 (32 connections open)" in first
    assert log.note("127.0.0.3", "source") is not None  # another source has its own minute
    quiet = [log.note("127.0.0.2", reason) for reason in ["full"] * 50 + ["timeout"] * 3]
    now[0] += 59.0
    quiet.append(log.note("127.0.0.2", "full"))
    assert quiet == [None] * 54
    now[0] += 1.0
    line = log.note("127.0.0.2", "full")
    assert "52 (32 connections open)" in line and "3 (no whole request" in line, line
    assert "in the last minute" in line


class FakeLoop:
    """The host's side: watched descriptors served by a real select(), timers on a fake clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers = Timers()
        self.handlers: dict = {}

    def server(self, guard=None) -> HttpServer:
        app = lambda request: Response(200, "text/plain", f"{request.path}\n".encode())
        server = HttpServer("127.0.0.1:0", app, watch=self.handlers.__setitem__,
                            unwatch=self.handlers.pop, call_at=self.timers.call_at,
                            cancel=self.timers.cancel, clock=lambda: self.now, guard=guard)
        server.listen()
        return server

    def pump(self, passes: int = 20) -> None:
        for _ in range(passes):
            readable, _, _ = select.select(list(self.handlers), [], [], 0.01)
            for fd in readable:
                handler = self.handlers.get(fd)
                if handler is not None:
                    handler()
            self.timers.run_due(self.now)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def test_the_loop_server_answers_once_and_closes_an_idle_connection_at_its_deadline():
    loop = FakeLoop()
    server = loop.server()
    idle, asking, oversized = (connect(server.port) for _ in range(3))
    loop.pump()
    assert server.connections == 3
    asking.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    oversized.sendall(b"GET / HTTP/1.1\r\nX: " + b"a" * (2 * metrics_http.HEAD_LIMIT))
    loop.pump()
    answer = asking.recv(4096)
    assert answer.startswith(b"HTTP/1.0 200 OK\r\n") and b"Connection: close" in answer, answer
    assert answer.endswith(b"\r\n\r\n/readyz\n") and closed_by_peer(asking)
    assert oversized.recv(4096).startswith(b"HTTP/1.0 431 ")
    assert server.connections == 1 and not closed_by_peer(idle)
    loop.now += metrics_http.TIMEOUT_S - 0.1
    loop.pump()
    assert not closed_by_peer(idle), "closed before its deadline"
    loop.now += 0.2
    loop.pump()
    assert closed_by_peer(idle) and server.connections == 0 and len(loop.timers) == 0
    server.close()
    assert loop.handlers == {}


class Account:
    """The descriptor account as the server sees it (supervisor/routing/connections.py's ConnectionGuard)."""

    def __init__(self) -> None:
        self.budget, self.held = True, 0

    def can_accept(self) -> bool:
        return self.budget

    def opened(self) -> None:
        self.held += 1

    def closed(self) -> None:
        self.held -= 1


def test_the_loop_server_refuses_beyond_its_shares_and_when_the_budget_is_spent():
    loop = FakeLoop()
    account = Account()
    server = loop.server(guard=account)
    mine = [connect(server.port) for _ in range(metrics_http.PER_SOURCE + 2)]
    other = connect(server.port, "127.0.0.2")
    loop.pump()
    assert server.connections == account.held == metrics_http.PER_SOURCE + 1
    assert [closed_by_peer(sock) for sock in mine[-3:]] == [False, True, True]
    account.budget = False
    refused = connect(server.port, "127.0.0.3")
    loop.pump()
    assert closed_by_peer(refused) and not closed_by_peer(other)
    server.pause()  # the guard pauses it with the daemon's other listeners: out of the poller
    assert server._listener.fileno() not in loop.handlers
    server.resume()
    assert server._listener.fileno() in loop.handlers
    server.close()
    assert account.held == 0
    for sock in (*mine, other, refused):
        sock.close()


# -- the daemon under an idle-connection flood ------------------------------------------------


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def open_idle(port: int, count: int, sources: list[str]) -> list[socket.socket]:
    """``count`` non-blocking connects spread over ``sources``, none of which sends a byte."""
    sockets = []
    for index in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((sources[index % len(sources)], 0))
        assert sock.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
        sockets.append(sock)
    return sockets


@pytest.mark.slow
def test_an_idle_connection_flood_costs_no_thread_and_cannot_take_the_daemon_down():
    nofile = 1024
    with Daemon([echo("echo", workers=1)], daemon={"metrics": "127.0.0.1:0"}, nofile=nofile) as daemon:
        base = metrics_url(daemon)
        port = int(base.rsplit(":", 1)[1])
        daemon.wait_ready()
        pid = daemon.process.pid
        reserve = int(re.search(r"client connections: at most \d+ \(fd limit \d+, reserve (\d+)\)",
                                daemon.log()).group(1))
        assert get(base + "/metrics")[0] == 200
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        with Client(daemon.endpoint, timeout=10) as client:
            # A daemon that has served: its first tracked reply starts pyzmq's garbage-collector
            # thread (its own context: 3 threads, 7 descriptors), once, and that is no flood's.
            client.infer("echo", {"x": x})
        threads_before, fds_before = threads(pid), fd_count(pid)
        sources = [f"127.0.0.{n}" for n in range(2, 10)]  # 8 sources: their shares exceed the cap
        flood = open_idle(port, 500, sources)
        try:
            poll_until(lambda: daemon.log().count("metrics: closed connection(s) from") >= len(sources)
                       or daemon.check_running(), 20, message="every source refused")
            assert threads(pid) <= threads_before + 2
            fds = fd_count(pid)
            assert fds <= fds_before + metrics_http.MAX_CONNECTIONS + 8, (fds, fds_before)
            assert fds < nofile - reserve
            status = daemon.status()
            assert not status["daemon"]["limits"]["listeners_paused"]
            with Client(daemon.endpoint, timeout=10) as client:  # the frontends were not paused
                assert np.array_equal(next(iter(client.infer("echo", {"x": x}).values())), x)
            print(f"flood: threads {threads_before} -> {threads(pid)}, descriptors {fds_before} -> "
                  f"{fds} (limit {nofile}, reserve {reserve})")
            # The idle connections' deadline closes them while the flood still holds its end.
            poll_until(lambda: fd_count(pid) <= fds_before + 2, 20,
                       message="the idle connections closed at their deadline")
            samples = poll_until(lambda: scrape(base), 10, message="a fresh scrape")
            assert value(samples, "modelwarden_workers", model="echo", state="READY") == 1
            assert value(samples, "modelwarden_ready") == 1
        finally:
            for sock in flood:
                sock.close()
        assert daemon.process.poll() is None
        lines = daemon.log().count("metrics: closed connection(s) from")
        assert lines <= 2 * len(sources), lines  # once a minute per source, not once per refusal
        assert "Too many open files" not in daemon.log()
        assert daemon.stop() == 0


def test_scrapes_of_one_snapshot_share_one_render():
    from prometheus_client import CollectorRegistry

    from modelwarden.supervisor.metrics import MetricsApp, Telemetry

    class CountingCollector:
        renders = 0

        def collect(self):
            CountingCollector.renders += 1
            return []

    class Answered:
        model = "m"

    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    registry.register(CountingCollector())
    telemetry.publish({}, lambda pool: 0)
    app = MetricsApp(registry, telemetry)
    plain = metrics_http.Request("GET", "/metrics", {}, {})
    gzipped = metrics_http.Request("GET", "/metrics", {}, {"accept-encoding": "gzip"})
    first = [app(plain).body for _ in range(20)]
    assert app(gzipped).headers == (("Content-Encoding", "gzip"),)
    assert CountingCollector.renders == 2 and len(set(first)) == 1  # one per format
    telemetry.requests.answered(Answered(), "ok", None)
    telemetry.publish({}, lambda pool: 0)
    page = app(plain).body.decode()
    assert CountingCollector.renders == 3
    assert 'modelwarden_requests_total{code="ok",model="m",version=""} 1.0' in page
