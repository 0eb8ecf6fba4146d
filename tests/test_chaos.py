"""The chaos suite: real faults in real worker processes, under load.

For every scenario: sent == ok + typed errors; ok == sent where a retry must hide the fault; the
pool is back to full READY; no process holds a buffer descriptor (the autouse fixture in conftest).
The long soak (many minutes, many kills) is bench/soak.py.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from modelwarden.client.client import Client, Poison
from tests.faulty import MARKER, reference
from tests.helpers import (ROOT, Daemon, alive, faulty_model, memfd_holders, poll_until,
                           readline_within)
from tests.load import CapacitySampler, run_load, sigkill_storm

pytestmark = pytest.mark.slow

CHAOS = {"start_seconds": 0.5, "heartbeat_timeout": 2.0, "kill_grace": 1.0, "timeout": 90.0,
         "backoff_initial": 0.1, "max_start_failures": 20}


def chaos_model(name: str, fault: str = "none", workers: int = 2, **kwargs) -> dict:
    return faulty_model(name, fault, workers=workers, kwargs=kwargs, **CHAOS)


def back_to_full_ready(daemon: Daemon, timeout: float = 90) -> None:
    poll_until(lambda: all(model["ready"] == model["workers"] for model in daemon.status()["models"]),
               timeout, message="every worker READY again")


def assert_no_request_lost(counts) -> None:
    assert counts.reconciles(), counts
    assert counts.ok == counts.sent and counts.wrong == 0, counts


def test_sigkill_storm_under_load_loses_nothing():
    with Daemon([chaos_model("storm")]) as daemon:
        daemon.wait_ready()
        counts, kills = sigkill_storm(daemon, "storm", reference)
        assert len(kills) == 12, kills
        assert counts.sent > 100, counts
        assert_no_request_lost(counts)
        back_to_full_ready(daemon)


@pytest.mark.parametrize("fault", ["segfault", "exit0"])
def test_a_worker_dying_in_forward_is_hidden_by_the_retry(fault, tmp_path):
    # once: the sibling that takes the retry is not armed itself (two armed workers in step
    # would make the retried request die twice: POISON, a different mechanism)
    model = chaos_model("crashy", fault, after=25, once=str(tmp_path / "armed"))
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        counts = run_load(daemon.endpoint, "crashy", reference, clients=4, requests=40)
        assert_no_request_lost(counts)
        back_to_full_ready(daemon)
        causes = [c["cause"] for w in daemon.workers() for c in w["restart_causes"]]
        expected = "SIGSEGV" if fault == "segfault" else "exit 0"
        assert any(expected in cause for cause in causes), causes


def test_a_hung_forward_is_killed_and_its_request_retried(tmp_path):
    with Daemon([chaos_model("hangs", "hang", after=30, once=str(tmp_path / "armed"))]) as daemon:
        daemon.wait_ready()
        counts = run_load(daemon.endpoint, "hangs", reference, clients=2, requests=40)
        assert_no_request_lost(counts)
        back_to_full_ready(daemon)
        causes = [c["cause"] for w in daemon.workers() for c in w["restart_causes"]]
        assert any(cause in ("SIGTERM", "SIGKILL") for cause in causes), causes
        assert "no heartbeat" in daemon.log()


def test_a_model_that_garbles_its_link_is_killed_and_nothing_is_lost(tmp_path):
    """A model's code can find its worker's link in its own process and write on it: what is no
    frame ends the link, the worker is killed at once and its requests are retried."""
    model = chaos_model("garbles", "garble_link", after=20, once=str(tmp_path / "armed"))
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        counts = run_load(daemon.endpoint, "garbles", reference, clients=4, requests=40)
        assert_no_request_lost(counts)
        back_to_full_ready(daemon)
        log = daemon.log()
        assert "the peer wrote a message of 0 parts: not a link frame; killing it" in log, log[-3000:]
        causes = [c["cause"] for w in daemon.workers() for c in w["restart_causes"]]
        assert any(cause in ("SIGTERM", "SIGKILL") for cause in causes), causes
        assert "no heartbeat" not in log  # killed for its link, not found hung later
        assert daemon.process.poll() is None


def test_a_hung_probe_is_caught_and_the_worker_replaced(tmp_path):
    # batch 1 is only ever the probe here (clients send 2..5 rows): calls 1-8 are warm-up,
    # baseline and the first probe; the second probe hangs, in the first worker only (once:
    # a replacement that hung too would be replaced probe.max_replacements times, then FATAL)
    model = chaos_model("probehang", "hang", workers=1, after=8, only_batch=1,
                        once=str(tmp_path / "armed"))
    # Heartbeats may not be what catches it: a hung forward also stops them, so give the
    # heartbeat check a minute and leave the probe timeout alone to find the hang.
    model.update(heartbeat_timeout=60.0, drain_timeout=1.0)
    model["probe"] = {"interval": 0.3, "timeout": 1.0}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        first = daemon.workers()[0]["pid"]
        poll_until(lambda: daemon.workers()[0]["pid"] not in (first, None)
                   and daemon.workers()[0]["state"] == "READY", 60, message="a replacement")
        counts = run_load(daemon.endpoint, "probehang", reference, clients=2, requests=10,
                          make_input=lambda rng: torch.randn(rng.randint(2, 5), 8))
        assert_no_request_lost(counts)
        assert "no answer in 1.0s" in daemon.log()
        assert "no heartbeat" not in daemon.log()


def test_poison_input_is_answered_poison_and_the_pool_recovers():
    with Daemon([chaos_model("victim", "poison")]) as daemon:
        daemon.wait_ready()
        pids = set(daemon.worker_pids())
        with Client(daemon.endpoint, timeout=90) as client:
            poisoned = torch.full((2, 8), MARKER)
            with pytest.raises(Poison):
                client.infer("victim", poisoned)
        back_to_full_ready(daemon)
        assert not pids & set(daemon.worker_pids())  # it killed both workers it touched
        counts = run_load(daemon.endpoint, "victim", reference, clients=2, requests=20)
        assert_no_request_lost(counts)


def test_a_request_beside_a_poison_input_on_its_worker_is_answered_and_the_poison_dies_alone():
    # One worker holding two requests (max_inflight 2, the default): the poison one dies half a
    # second into its forward, while the other waits behind it on the same worker.
    with Daemon([chaos_model("victim", "poison", workers=1, delay=0.5)]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=90) as client:
            poisoned = client.submit("victim", torch.full((2, 8), MARKER))
            innocent = torch.randn(2, 8)
            beside = client.submit("victim", innocent)
            assert torch.allclose(beside.result(90), reference(innocent))
            with pytest.raises(Poison):
                poisoned.result(90)
        assert "died holding 2 request(s)" in daemon.log()  # they were on one worker together


@pytest.mark.parametrize("fault", ["drift", "nan"])
def test_a_drifting_worker_is_replaced_before_it_is_retired(fault):
    model = chaos_model("drifty", fault, workers=1, after=12)
    model["probe"] = {"interval": 0.2, "failures": 3, "latency_slack_ms": 5000}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        first = daemon.workers()[0]["pid"]
        with CapacitySampler(daemon, "drifty") as capacity:
            replaced = poll_until(lambda: next((w for w in daemon.workers()
                                                if w["pid"] != first and w["state"] == "READY"), None),
                                  90, message="a replacement READY")
            poll_until(lambda: not alive(first), 30, message="the drifting worker gone")
        assert capacity.minimum() >= 1, "capacity dipped during the replacement"
        assert any("failed probes" in c["cause"] for c in replaced["restart_causes"])
        expected = "NaN" if fault == "nan" else "drifted"
        assert expected in daemon.log()


def test_a_leaking_worker_is_recycled_past_max_rss():
    model = chaos_model("leaky", "leak", workers=1, after=0, leak_mb=40)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        rss = daemon.workers()[0]["rss_bytes"]
        model["max_rss"] = rss + 200 * 2**20
        with Client(daemon.endpoint) as client:
            def leaking_visibly():  # a request per poll: the status shows the leak's slope
                client.infer("leaky", torch.randn(2, 8))
                trend = daemon.workers()[0]["rss_trend_bytes_per_s"]
                return trend is not None and trend > 1e6
            poll_until(leaking_visibly, 30, interval=0.2, message="a positive RSS trend")
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        first = daemon.workers()[0]["pid"]
        with CapacitySampler(daemon, "leaky") as capacity:
            counts = run_load(daemon.endpoint, "leaky", reference, clients=1, requests=12)
            assert_no_request_lost(counts)
            worker = poll_until(lambda: next((w for w in daemon.workers()
                                              if w["pid"] != first and w["state"] == "READY"), None),
                                60, message="a recycled worker")
            poll_until(lambda: not alive(first), 30, message="the leaking worker gone")
        assert any("max_rss" in c["cause"] for c in worker["restart_causes"])
        assert capacity.minimum() >= 1, "capacity dipped: retired before it was replaced"


ORPHAN_CLIENT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from modelwarden.client.client import Client
    client = Client({endpoint!r})
    x = torch.ones(8192, 8)   # 256 KiB: travels in shared memory
    client.infer("survivor", x)
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_supervisor_sigkill_leaves_no_orphan_and_no_leaked_buffer():
    model = chaos_model("survivor", "none", workers=2)
    with Daemon([model], daemon={"shm_threshold": 4096}) as daemon:
        daemon.wait_ready()
        workers = daemon.worker_pids()
        script = ORPHAN_CLIENT.format(root=str(ROOT), endpoint=daemon.endpoint)
        client = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert readline_within(client.stdout).strip() == "ready"
        assert client.pid in memfd_holders() and daemon.process.pid in memfd_holders()
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait(30)
        for pid in workers:
            poll_until(lambda: not alive(pid), 15, message=f"worker {pid} gone with its supervisor")
        client.kill()  # the client dies too, while no daemon is there
        client.wait(30)
        # nobody is left holding its buffers: the kernel freed them, no sweeper needed
        poll_until(lambda: not memfd_holders(exclude=(os.getpid(),)), 15,
                   message="no buffer descriptor held anywhere")
        daemon.start()  # the same configuration, the same runtime directory
        daemon.wait_ready()


def test_restarting_one_worker_leaves_the_others_alone():
    with Daemon([chaos_model("pair", workers=2)]) as daemon:
        daemon.wait_ready()
        before = {w["id"]: w["pid"] for w in daemon.workers()}
        with CapacitySampler(daemon, "pair") as capacity:
            assert daemon.command("restart", target="pair#1")["restarted"] == ["pair#1"]
            poll_until(lambda: {w["id"]: w["pid"] for w in daemon.workers("pair", "READY")}.get("pair#1")
                       not in (None, before["pair#1"]) and len(daemon.workers()) == 2, 60,
                       message="pair#1 replaced")
            poll_until(lambda: not alive(before["pair#1"]), 30, message="the old pair#1 gone")
        assert {w["id"]: w["pid"] for w in daemon.workers()}["pair#0"] == before["pair#0"]
        assert capacity.minimum() >= 2, "capacity dipped: pair#1 retired before it was replaced"
