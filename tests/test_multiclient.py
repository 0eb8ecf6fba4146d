"""The multi-endpoint client against real daemons on loopback tcp with CURVE on: it spreads the
load, survives a SIGKILLed daemon with no failed request, uses a restarted one again, tries
another daemon on OVERLOADED, and never runs a request more than twice (POISON)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from modelwarden.client.client import Client
from modelwarden.client.connect import connect, connect_async
from modelwarden.shared.errors import Overloaded, Poison
from modelwarden.client.multiclient import MultiClient
from tests.faulty import reference
from tests.fleet import (MODEL, FleetKeys, Load, all_running, fleet_daemon, fleet_model,
                         kill_and_restart_under_load, served)
from tests.helpers import Daemon, memfd_holders, poll_until
from tests.helpers import free_port


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> FleetKeys:
    return FleetKeys(tmp_path_factory.mktemp("fleetkeys"))


@pytest.fixture
def pair(keys):
    with all_running([fleet_daemon(keys, f"tcp://127.0.0.1:{free_port()}", [fleet_model(version=name)])
                      for name in ("first", "second")]) as daemons:
        yield daemons


def endpoints(daemons) -> list[str]:
    return [daemon.tcp for daemon in daemons]


def test_one_endpoint_stays_the_single_client(keys, monkeypatch):
    assert type(connect("tcp://127.0.0.1:1", **keys.alice())) is Client
    assert type(connect(["tcp://127.0.0.1:1"], **keys.alice())) is Client
    assert type(Client(["tcp://127.0.0.1:1"], **keys.alice())) is Client
    monkeypatch.setenv("MODELWARDEN_ENDPOINT", "tcp://127.0.0.1:1, tcp://127.0.0.1:2")
    with connect(**keys.alice()) as client:
        assert type(client) is MultiClient
        assert client.endpoints == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    with pytest.warns(DeprecationWarning, match=r"modelwarden\.connect\(endpoints\)"):
        client = Client(**keys.alice())  # several endpoints through Client: still served
    with client:
        assert type(client) is MultiClient


def test_requests_spread_over_both_daemons_sync_and_async(pair, keys):
    with connect(endpoints(pair), **keys.alice()) as client:
        assert client.hello()["models"][0]["name"] == MODEL
        both_up(client)
        xs = [torch.randn(3, 8) for _ in range(40)]
        futures = [client.submit(MODEL, x) for x in xs]
        for x, future in zip(xs, futures):
            assert torch.allclose(future.result(60), reference(x), rtol=1e-4, atol=1e-5)

    async def main():
        async with connect_async(",".join(endpoints(pair)), **keys.alice()) as client:
            await asyncio.to_thread(both_up, client)
            return await asyncio.gather(*(client.infer(MODEL, x) for x in xs))

    for x, y in zip(xs, asyncio.run(main())):
        assert torch.allclose(y, reference(x), rtol=1e-4, atol=1e-5)
    first, second = served(pair[0]), served(pair[1])
    assert first + second == 80
    assert min(first, second) >= 20, (first, second)  # least outstanding spreads a burst


def test_sigkill_one_daemon_under_load_fails_nothing_and_a_restart_takes_load_again(pair, keys):
    with connect(endpoints(pair), timeout=30.0, **keys.alice()) as client:
        load = Load(client, threads=4)
        with load:
            def stop_load() -> dict:
                load.__exit__(None, None, None)
                return load.summary()
            summary = kill_and_restart_under_load(pair[0], pair[1], stop_load,
                                                  restart=lambda daemon: daemon.start())
    assert summary["failed"] == 0 and summary["wrong"] == 0, summary
    assert summary["sent"] == summary["ok"] > 100, summary


def test_a_silent_daemon_is_down_after_its_heartbeats_and_up_once_it_answers(pair, keys):
    """SIGSTOP keeps the connection open (the kernel still ACKs): only the heartbeats see it."""
    silent, other = pair
    with connect(endpoints(pair), timeout=30.0, heartbeat_interval=0.2, heartbeat_timeout=1.0,
                **keys.alice()) as client:
        both_up(client)
        silent.process.send_signal(signal.SIGSTOP)
        try:
            futures = [client.submit(MODEL, torch.randn(2, 8)) for _ in range(10)]
            poll_until(lambda: client.health()[silent.tcp] == "DOWN", 10,
                       message="the stopped daemon marked DOWN")
            for future in futures:  # those it held were re-sent to the other
                assert future.result(30).shape == (2, 8)
        finally:
            silent.process.send_signal(signal.SIGCONT)
        poll_until(lambda: client.health()[silent.tcp] == "UP", 10, message="back UP")
        replies = [future.result(30) for future in
                   [client.submit(MODEL, torch.randn(2, 8), details=True) for _ in range(20)]]
        assert {reply.version for reply in replies} == {"first", "second"}  # used again


def test_overloaded_from_one_daemon_tries_the_other(keys):
    slow = fleet_model(kwargs={"fault": "slow", "delay": 0.2}, max_queue=1)
    roomy = fleet_model(kwargs={"fault": "slow", "delay": 0.2}, max_queue=1000)
    daemons = [fleet_daemon(keys, f"tcp://127.0.0.1:{free_port()}", [model])
               for model in (slow, roomy)]
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        x = torch.randn(2, 8)
        with Client(daemons[0].tcp, **keys.alice()) as alone:  # the control: it does refuse
            outcomes = burst(alone, x, 8)
        assert any(isinstance(outcome, Overloaded) for outcome in outcomes), outcomes
        with connect(endpoints(daemons), **keys.alice()) as client:
            both_up(client)
            outcomes = burst(client, x, 8)
        assert all(isinstance(outcome, torch.Tensor) for outcome in outcomes), outcomes
    finally:
        for daemon in daemons:
            daemon.cleanup()


def test_every_daemon_overloaded_fails_with_overloaded(keys):
    tight = fleet_model(kwargs={"fault": "slow", "delay": 0.3}, max_queue=1)
    daemons = [fleet_daemon(keys, f"tcp://127.0.0.1:{free_port()}", [tight]) for _ in range(2)]
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        with connect(endpoints(daemons), **keys.alice()) as client:
            both_up(client)
            outcomes = burst(client, torch.randn(2, 8), 12)
        kinds = {type(outcome).__name__ for outcome in outcomes}
        assert kinds == {"Tensor", "Overloaded"}, outcomes
    finally:
        for daemon in daemons:
            daemon.cleanup()


def test_a_request_whose_two_daemons_die_is_poison_and_not_sent_a_third_time(keys):
    hang = fleet_model(kwargs={"fault": "hang", "after": 2})  # warm-up passes, then it hangs
    daemons = [fleet_daemon(keys, f"tcp://127.0.0.1:{free_port()}", [hang]) for _ in range(2)]
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        with connect(endpoints(daemons), timeout=60.0, **keys.alice()) as client:
            both_up(client)
            future = client.submit(MODEL, torch.randn(2, 8))
            first = poll_until(lambda: holder(daemons), 30, message="a daemon holding the request")
            first.process.kill()
            first.process.wait(30)
            second = poll_until(lambda: holder(daemons), 30, message="the request re-sent")
            assert second is not first
            first.start()  # back: but the request has run its two times
            first.wait_ready()
            both_up(client)
            second.process.kill()
            with pytest.raises(Poison, match="two daemons"):
                future.result(30)
            assert first.status()["daemon"]["pending"] == 0
    finally:
        for daemon in daemons:
            daemon.cleanup()


def both_up(client) -> None:
    poll_until(lambda: set(client.health().values()) == {"UP"}, 30, message="every daemon UP")


def holder(daemons):
    """The daemon that holds a client request now, if one does."""
    for daemon in daemons:
        if daemon.process.poll() is None and daemon.status()["daemon"]["pending"] > 0:
            return daemon
    return None


def burst(client, x: torch.Tensor, count: int) -> list:
    futures = [client.submit(MODEL, x) for _ in range(count)]
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(60))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


def test_several_ipc_daemons_use_shared_memory_each(keys):
    daemons = [Daemon([fleet_model(version=name)]) for name in ("first", "second")]
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        with connect([daemon.endpoint for daemon in daemons]) as client:
            both_up(client)
            xs = [torch.randn(8192, 8) for _ in range(8)]  # 256 KiB: over the shm threshold
            futures = [client.submit(MODEL, x, details=True) for x in xs]
            replies = [future.result(60) for future in futures]
            assert client.hello()["shm"]["enabled"] is True
            assert os.getpid() in memfd_holders()  # the inputs went through our buffers
        for x, reply in zip(xs, replies):
            assert torch.allclose(reply.outputs, reference(x), rtol=1e-4, atol=1e-5)
        assert {reply.version for reply in replies} == {"first", "second"}
    finally:
        for daemon in daemons:
            daemon.cleanup()


def test_the_cli_infers_over_several_endpoints_and_fails_over(pair, keys, tmp_path):
    import subprocess
    import sys

    import numpy as np

    from tests.helpers import ROOT

    x = torch.randn(3, 8)
    np.save(tmp_path / "x.npy", x.numpy())
    key_args = ["--server-key", keys.alice()["server_key"], "--client-key", keys.alice()["client_key"]]

    def infer_cli() -> torch.Tensor:
        out = tmp_path / "y.npy"
        out.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "modelwarden", "infer", MODEL, "-i",
                               str(tmp_path / "x.npy"), "-o", str(out), "--endpoint",
                               ",".join(endpoints(pair)), *key_args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return torch.from_numpy(np.load(out))

    assert torch.allclose(infer_cli(), reference(x), rtol=1e-4, atol=1e-5)
    pair[0].process.kill()
    pair[0].process.wait(30)
    served_before = served(pair[1])
    assert torch.allclose(infer_cli(), reference(x), rtol=1e-4, atol=1e-5)  # the other daemon
    assert served(pair[1]) == served_before + 1
