"""``[daemon] metrics``: Prometheus text, /healthz and /readyz, scraped over loopback from the real
daemon and parsed with prometheus_client's own parser."""

from __future__ import annotations

import os
import re
import signal
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelwarden.shared.client import BadInput, Client, ModelError, UnknownModel
from modelwarden.shared.config import ConfigError, load_settings
from tests.faulty import MARKER
from modelwarden.shared import protocol
from tests.helpers import Daemon, faulty_model, poll_until, raw_request

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
            with pytest.raises(BadInput):
                client.infer("echo", {"x": np.ones((3, 4), np.int64)})
            with pytest.raises(UnknownModel):
                client.infer("no-such-model", {"x": x})
        # Counters reach the scrape at the loop's next tick (0.1 s).
        samples = poll_until(lambda: (lambda found: value(found, "modelwarden_requests_total", model="echo",
                                                          code="ok") == 3 and found)(scrape(base)),
                             5, message="three ok answers counted")
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
