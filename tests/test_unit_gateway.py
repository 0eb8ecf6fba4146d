"""supervisor/gatewaykeeper.py without processes: the state table, exit descriptions, the spec."""

from __future__ import annotations

import signal

from modelwarden.shared.config import Settings
from modelwarden.supervisor import gatewaykeeper
from modelwarden.supervisor.gatewaykeeper import GATEWAY_TRANSITIONS, GatewayState as G


def test_every_state_has_its_edges_and_a_shutdown_is_final():
    assert set(GATEWAY_TRANSITIONS) == set(G)
    assert GATEWAY_TRANSITIONS[G.STOPPING] == {G.STOPPED}
    for state in (G.STARTING, G.READY):
        assert {G.BACKOFF, G.STOPPING} <= GATEWAY_TRANSITIONS[state]  # died / shutdown
    assert GATEWAY_TRANSITIONS[G.BACKOFF] == {G.STARTING, G.STOPPED}


def test_exits_are_described_as_the_workers_are():
    assert gatewaykeeper.exit_cause(-signal.SIGKILL) == "SIGKILL"
    assert gatewaykeeper.exit_cause(3) == "exit 3 (boot error)"
    assert gatewaykeeper.exit_cause(0) == "exit 0 (clean)"
    assert gatewaykeeper.exit_cause(77) == "exit 77"


def test_the_spec_names_the_ipc_frontend_and_the_daemon_s_message_limit(tmp_path):
    settings = Settings(daemon={"runtime_dir": str(tmp_path), "max_message_bytes": 1234,
                                "frontend": ["tcp://127.0.0.1:5555", f"ipc://{tmp_path}/f.sock"]},
                        gateway={"grpc": "127.0.0.1:0"})
    spec = gatewaykeeper.gateway_spec(settings, 42)
    assert spec.frontend == f"ipc://{tmp_path}/f.sock" and spec.max_message_bytes == 1234
    assert spec.http is None and spec.grpc == "127.0.0.1:0" and spec.supervisor_pid == 42
    assert gatewaykeeper.cannot_run(settings) is None
    tcp_only = Settings(daemon={"frontend": ["tcp://127.0.0.1:5555"]}, gateway={"grpc": "127.0.0.1:0"})
    assert "needs an ipc:// frontend" in gatewaykeeper.cannot_run(tcp_only)


def test_the_spec_carries_the_gateway_s_budgets(tmp_path):
    settings = Settings(daemon={"runtime_dir": str(tmp_path), "max_message_bytes": 1000,
                                "frontend": [f"ipc://{tmp_path}/f.sock"]},
                        gateway={"grpc": "127.0.0.1:0", "max_json_bytes": "1KiB",
                                 "identity_share": 0.5})
    spec = gatewaykeeper.gateway_spec(settings, 42)
    assert spec.max_json_bytes == 1024 and spec.identity_share == 0.5
    assert spec.max_bytes_in_flight == 4000 and spec.max_requests_in_flight == 1024


def test_trim_gives_back_only_free_buffers_idle_since_the_last_trim():
    from modelwarden.shared.shm import ShmArena

    arena = ShmArena()  # no channel: nothing to unregister
    big = [arena.alloc(4 * 1024 * 1024) for _ in range(3)]
    held = arena.alloc(4 * 1024 * 1024)
    for region in big:
        region.release()
    assert arena.trim(keep_bytes=0) == 0  # just used: kept for one interval
    again = arena.alloc(4 * 1024 * 1024)  # reused since: kept
    assert arena.trim(keep_bytes=4 * 1024 * 1024) == 4 * 1024 * 1024  # one kept, one dropped
    assert len(arena._segments) == 3 and held.segment.fd >= 0  # in use: never dropped
    again.release()
    held.release()
    # the one kept by the budget goes now; the two just released, at the next trim
    assert arena.trim(keep_bytes=0) == 4 * 1024 * 1024
    assert arena.trim(keep_bytes=0) == 2 * 4 * 1024 * 1024
    assert not arena._segments and not arena.tokens()
    arena.close()
