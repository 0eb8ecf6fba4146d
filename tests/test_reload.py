"""Reload, versions and self-healing, against the real daemon: the configuration file is
rewritten and SIGHUP or ``modelwarden reload`` sent while clients keep sending; models are added,
removed, scaled and given new versions with no request failing; a new version records its own
golden probe output; a slot failing its probes is given up on after ``probe.max_replacements``;
a FATAL slot heals by itself after ``fatal_retry``.

Each test breaks when its mechanism breaks (see the mutations in the report of the change that
added it): a reload that ignores the file, a golden shared across versions, a replacement loop
without a limit, a FATAL slot that never retries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from modelwarden.shared import protocol
from modelwarden.client.client import Client, RemoteError
from tests.faulty import reference, weights
from tests.helpers import (ROOT, Daemon, alive, faulty_model, poll_until, raw_request,
                           rewrite_config)
from tests.load import CapacitySampler, run_load

pytestmark = pytest.mark.slow

QUICK = {"start_seconds": 0.5, "backoff_initial": 0.05, "kill_grace": 2.0}


rewrite = rewrite_config


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelwarden", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def model_row(daemon: Daemon, name: str) -> dict | None:
    return next((m for m in daemon.status()["models"] if m["name"] == name), None)


def infer_reply(daemon: Daemon, model: str) -> dict:
    """A raw infer's reply header: what every client receives."""
    x = np.ones((2, 8), np.float32)
    header = {"type": "infer", "id": 1, "model": model, "inputs": 0,
              "tensors": [{"dtype": "float32", "shape": [2, 8], "frame": 0}]}
    return raw_request(daemon.endpoint, [protocol.SIGNATURE, protocol.pack(header), x.tobytes()])


# -- reload under load --------------------------------------------------------------------------


def test_reload_under_load_adds_removes_scales_and_rolls_with_no_failed_request():
    keep = faulty_model("keep", workers=1, **QUICK)
    bump = faulty_model("bump", workers=1, version="v1", **QUICK)
    gone = faulty_model("gone", workers=1, **QUICK)
    with Daemon([keep, bump, gone]) as daemon:
        daemon.wait_ready()
        (bump_pid,) = [w["pid"] for w in daemon.workers("bump")]
        stop = threading.Event()
        results = {}

        def load(model: str) -> None:
            results[model] = run_load(daemon.endpoint, model, reference, clients=2,
                                      requests=10**6, stop=stop)

        loaders = [threading.Thread(target=load, args=(name,)) for name in ("keep", "bump")]
        with CapacitySampler(daemon, "bump") as capacity:
            for thread in loaders:
                thread.start()
            try:
                poll_until(lambda: sum(w["requests"] for w in daemon.workers()) >= 40, 60,
                           message="load flowing")
                rewrite(daemon, [{**keep, "workers": 2}, {**bump, "version": "v2"},
                                 faulty_model("added", workers=1, **QUICK)])
                daemon.process.send_signal(signal.SIGHUP)
                poll_until(lambda: model_row(daemon, "gone") is None, 30, message="gone removed")
                with pytest.raises(RemoteError) as removed:
                    with Client(daemon.endpoint, timeout=10) as client:
                        client.infer("gone", torch.ones(2, 8))
                assert removed.value.code == protocol.UNKNOWN_MODEL

                def settled():
                    workers = daemon.workers()
                    return (sorted(w["model"] for w in workers if w["state"] == "READY")
                            == ["added", "bump", "keep", "keep"] and len(workers) == 4
                            and [w["version"] for w in workers if w["model"] == "bump"] == ["v2"])

                poll_until(settled, 120, message="the new configuration in force")
                served = sum(w["requests"] for w in daemon.workers() if w["model"] != "added")
                poll_until(lambda: sum(w["requests"] for w in daemon.workers()
                                       if w["model"] != "added") >= served + 20, 60,
                           message="load still flowing after the reload")
            finally:
                stop.set()
                for thread in loaders:
                    thread.join(120)
        assert capacity.minimum() >= 1, "bump had no READY worker during its roll"
        assert not alive(bump_pid)
        for model, counts in results.items():
            assert counts.reconciles() and counts.failed == 0 and counts.wrong == 0, (model, counts)
            assert counts.ok >= 20, (model, counts)
        with Client(daemon.endpoint, timeout=30) as client:
            assert torch.allclose(client.infer("added", torch.ones(2, 8)), reference(torch.ones(2, 8)))
        assert infer_reply(daemon, "bump")["version"] == "v2"
        log = daemon.log()
        assert "reload: gone: removed" in log and "reload: added: added (1 worker(s))" in log
        assert "reload: keep: workers 1 -> 2" in log
        assert "reload: bump: rolling (version changed)" in log


def test_an_invalid_reload_changes_nothing_and_the_cli_says_why_with_exit_2():
    model = faulty_model("m", workers=1, **QUICK)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        before = daemon.worker_pids()
        good = daemon.config_path.read_text()
        daemon.config_path.write_text(good + "\n[[models]]\nname = \"m2\"\nsource = \"nope:x\"\n")
        result = cli("reload", "--admin", daemon.admin)
        assert result.returncode == 2, result
        assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
        assert "config error: models[1].source" in result.stderr
        assert "the running configuration is unchanged" in result.stderr
        assert "reload refused, the running configuration stays" in daemon.log()
        # A daemon setting that binds at start is refused by name, not half applied.
        daemon.config_path.write_text(good)
        rewrite(daemon, [model], frontend=[f"ipc://{daemon.dir}/other.sock"])
        result = cli("reload", "--admin", daemon.admin)
        assert result.returncode == 2 and "daemon.frontend: changed" in result.stderr, result
        assert [m["name"] for m in daemon.status()["models"]] == ["m"]
        # A golden file that exists but does not parse is refused before anything changes.
        daemon.config_path.write_text(good)
        garbage = daemon.dir / "garbage.npy"
        garbage.write_bytes(b"not an array")
        rewrite(daemon, [{**model, "probe": {"golden": str(garbage)}}])
        result = cli("reload", "--admin", daemon.admin)
        assert result.returncode == 2 and "config error: m.probe.golden" in result.stderr, result
        assert daemon.worker_pids() == before
        # The file put right: the same command applies it, and an unchanged file changes nothing.
        daemon.config_path.write_text(good)
        result = cli("reload", "--admin", daemon.admin)
        assert result.returncode == 0 and result.stdout.strip() == "reloaded: no change", result
        with Client(daemon.endpoint, timeout=10) as client:
            assert client.infer("m", torch.ones(2, 8)).shape == (2, 8)
        assert daemon.worker_pids() == before


def test_a_policy_change_applies_without_restarting_workers():
    model = faulty_model("m", workers=1, max_queue=1024, **QUICK)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        before = daemon.worker_pids()
        rewrite(daemon, [{**model, "max_queue": 1, "timeout": 7.0}])
        reply = daemon.command("reload")
        assert reply["changes"] == ["m: applied in place: max_queue, timeout"]
        assert daemon.worker_pids() == before and daemon.workers()[0]["restarts"] == 0


def test_scale_and_stop_commands_change_one_model_until_restart():
    model = faulty_model("m", workers=1, **QUICK)
    other = faulty_model("o", workers=1, **QUICK)
    with Daemon([model, other]) as daemon:
        daemon.wait_ready()
        (first,) = [w["pid"] for w in daemon.workers("m")]
        others = [w["pid"] for w in daemon.workers("o")]
        result = cli("scale", "m", "2", "--admin", daemon.admin)
        assert result.returncode == 0 and result.stdout.strip() == "reloaded: m: workers 1 -> 2", result
        poll_until(lambda: len(daemon.workers("m", "READY")) == 2, 60, message="m scaled to 2")
        assert first in daemon.worker_pids()  # the first worker was not touched
        result = cli("stop", "m#1", "--admin", daemon.admin)
        assert result.returncode == 0 and result.stdout.strip() == "stopping: m#1", result
        poll_until(lambda: [w["state"] for w in daemon.workers("m")] == ["READY", "STOPPED"], 30,
                   message="m#1 stopped")
        assert daemon.command("stop", target="m")["stopped"] == ["m#0"]
        poll_until(lambda: [w["state"] for w in daemon.workers("m")] == ["STOPPED", "STOPPED"], 30,
                   message="m stopped")
        with pytest.raises(RemoteError) as refused:
            with Client(daemon.endpoint, timeout=10) as client:
                client.infer("m", torch.ones(2, 8))
        assert refused.value.code == protocol.NO_WORKER
        assert daemon.command("restart", target="m#0")["restarted"] == ["m#0"]
        poll_until(lambda: daemon.workers("m", "READY"), 60, message="m#0 back")
        # A reload re-reads the file: one worker (the scale is undone) and nothing held.
        assert daemon.command("reload")["changes"] == ["m: workers 2 -> 1"]
        poll_until(lambda: [w["state"] for w in daemon.workers("m")] == ["READY"], 60,
                   message="m back to the file's one worker")
        assert [w["pid"] for w in daemon.workers("o")] == others and daemon.process.poll() is None
        bad = cli("scale", "nosuch", "2", "--admin", daemon.admin)
        assert bad.returncode == 2 and "no model named 'nosuch'" in bad.stderr, bad


# -- versions and the golden output -------------------------------------------------------------


PROBES = {"interval": 0.2, "failures": 2, "latency_slack_ms": 5000}


def test_a_new_version_records_its_own_golden_and_serves_without_a_probe_failure():
    v1 = faulty_model("m", workers=1, probe=PROBES, **QUICK)
    with Daemon([v1]) as daemon:
        daemon.wait_ready()
        poll_until(lambda: model_row(daemon, "m")["golden"], 30, message="v1's golden recorded")
        old_version = model_row(daemon, "m")["version"]
        assert infer_reply(daemon, "m")["version"] == old_version
        rewrite(daemon, [{**v1, "kwargs": {**v1["kwargs"], "gain": 2.0}}])  # new weights
        changes = daemon.command("reload")["changes"]
        assert changes == ["m: rolling (kwargs changed)"], changes
        new_version = model_row(daemon, "m")["version"]
        assert new_version != old_version

        def new_worker_probed_ok_many_times():
            workers = daemon.workers("m", "READY")
            return (len(workers) == 1 and workers[0]["version"] == new_version
                    and workers[0]["probe"]["ok"] and workers[0]["requests"] == 0
                    and workers[0]["ready_s"] > 2.0)

        poll_until(new_worker_probed_ok_many_times, 90, message="v2 serving, its probes passing")
        worker = daemon.workers("m")[0]
        assert worker["restarts"] == 1 and worker["probe"]["consecutive_failures"] == 0
        assert "probe failed" not in daemon.log()
        reply = infer_reply(daemon, "m")
        assert reply["version"] == new_version and reply["worker"] == "m#0"
        with Client(daemon.endpoint, timeout=10) as client:
            x = torch.ones(2, 8)
            answer = client.infer("m", x, details=True)
            assert torch.allclose(answer.outputs, x @ (weights() * 2.0) + 1.0)
            assert answer.version == new_version


def test_new_weights_in_place_and_a_restart_make_a_new_version_with_its_own_golden(tmp_path):
    # The scenario: the model's code (its weights) changes under an unchanged
    # configuration and `modelwarden restart` runs. The version is derived at each spawn, so the
    # new worker is a new version and records its own golden instead of failing against the old.
    module = tmp_path / "mw_weights.py"
    factory = "from tests.faulty import make_faulty\n\ndef build():\n    return make_faulty(gain={})\n"
    module.write_text(factory.format(1.0))
    model = {**faulty_model("w", probe=PROBES, **QUICK), "source": "python:mw_weights:build",
             "kwargs": {}}
    with Daemon([model], daemon={"python_path": [str(ROOT), str(tmp_path)]}) as daemon:
        daemon.wait_ready()
        poll_until(lambda: model_row(daemon, "w")["golden"], 30, message="the golden recorded")
        old_version = model_row(daemon, "w")["version"]
        module.write_text(factory.format(2.0))
        os.utime(module, ns=(1, 1))  # a same-size rewrite within the mtime's granularity
        assert daemon.command("restart", target="w")["restarted"] == ["w#0"]

        def new_version_serving():
            workers = daemon.workers("w")
            return (len(workers) == 1 and workers[0]["state"] == "READY"
                    and workers[0]["version"] != old_version and workers[0]["probe"]["ok"]
                    and workers[0]["ready_s"] > 2.0)

        poll_until(new_version_serving, 90, message="the new version serving, its probes passing")
        assert model_row(daemon, "w")["version"] == daemon.workers("w")[0]["version"]
        assert "probe failed" not in daemon.log() and daemon.workers("w")[0]["restarts"] == 1
        with Client(daemon.endpoint, timeout=10) as client:
            x = torch.ones(2, 8)
            assert torch.allclose(client.infer("w", x), x @ (weights() * 2.0) + 1.0)


def test_a_worker_always_failing_probes_is_replaced_max_replacements_times_then_fatal():
    # `after`: warm-up (2) and the probe baseline (5) run first; the first probe passes and is
    # recorded as the golden, every later one drifts: in every incarnation.
    drifting = faulty_model("drift", "drift", kwargs={"after": 8}, fatal_retry=0,
                            probe={**PROBES, "max_replacements": 2}, **QUICK)
    with Daemon([drifting]) as daemon:
        row = poll_until(lambda: daemon.workers("drift")[0]["state"] == "FATAL"
                         and daemon.workers("drift")[0], 120, message="the slot FATAL")
        assert row["restarts"] == 2, row
        assert [c["cause"].startswith("replaced: 2 failed probes") for c in row["restart_causes"]] == [True, True]
        assert model_row(daemon, "drift")["fatal_slots"] == ["drift#0"]
        assert "gave up after 2 replacement(s) for failed probes" in daemon.log()
        with pytest.raises(RemoteError) as refused:
            with Client(daemon.endpoint, timeout=10) as client:
                client.infer("drift", torch.ones(2, 8))
        assert refused.value.code == protocol.NO_WORKER


# -- FATAL heals by itself ----------------------------------------------------------------------


def test_a_fatal_slot_retries_by_itself_after_fatal_retry_and_heals(tmp_path):
    fault = tmp_path / "disk-full"
    fault.write_text("")
    broken = faulty_model("heal", "load_error", kwargs={"while_exists": str(fault)},
                          max_start_failures=1, fatal_retry=2.0, **QUICK)
    with Daemon([broken]) as daemon:
        row = poll_until(lambda: daemon.workers("heal")[0]["state"] == "FATAL"
                         and daemon.workers("heal")[0], 60, message="FATAL")
        assert 0 < row["retry_in_s"] <= 2.0
        poll_until(lambda: daemon.workers("heal")[0]["restarts"] >= 2, 60,
                   message="a second try on its own, still failing")
        assert daemon.workers("heal")[0]["state"] in ("FATAL", "STARTING", "LOADING")
        fault.unlink()  # the transient fault is gone
        poll_until(lambda: daemon.workers("heal", "READY"), 60, message="healed without a command")
        with Client(daemon.endpoint, timeout=10) as client:
            assert client.infer("heal", torch.ones(2, 8)).shape == (2, 8)
        assert "trying again (fatal_retry)" in daemon.log()
