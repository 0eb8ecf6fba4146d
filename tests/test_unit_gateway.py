"""supervisor/gateway.py without processes: the state table, exit descriptions, the spec."""

from __future__ import annotations

import signal

from modelwarden.shared.config import Settings
from modelwarden.supervisor import gateway
from modelwarden.supervisor.gateway import GATEWAY_TRANSITIONS, GatewayState as G


def test_every_state_has_its_edges_and_a_shutdown_is_final():
    assert set(GATEWAY_TRANSITIONS) == set(G)
    assert GATEWAY_TRANSITIONS[G.STOPPING] == {G.STOPPED}
    for state in (G.STARTING, G.READY):
        assert {G.BACKOFF, G.STOPPING} <= GATEWAY_TRANSITIONS[state]  # died / shutdown
    assert GATEWAY_TRANSITIONS[G.BACKOFF] == {G.STARTING, G.STOPPED}


def test_exits_are_described_as_the_workers_are():
    assert gateway.exit_cause(-signal.SIGKILL) == "SIGKILL"
    assert gateway.exit_cause(3) == "exit 3 (boot error)"
    assert gateway.exit_cause(0) == "exit 0 (clean)"
    assert gateway.exit_cause(77) == "exit 77"


def test_the_spec_names_the_ipc_frontend_and_the_daemon_s_message_limit(tmp_path):
    settings = Settings(daemon={"runtime_dir": str(tmp_path), "max_message_bytes": 1234,
                                "frontend": ["tcp://127.0.0.1:5555", f"ipc://{tmp_path}/f.sock"]},
                        gateway={"grpc": "127.0.0.1:0"})
    spec = gateway.gateway_spec(settings, 42)
    assert spec.frontend == f"ipc://{tmp_path}/f.sock" and spec.max_message_bytes == 1234
    assert spec.http is None and spec.grpc == "127.0.0.1:0" and spec.supervisor_pid == 42
    assert gateway.cannot_run(settings) is None
    tcp_only = Settings(daemon={"frontend": ["tcp://127.0.0.1:5555"]}, gateway={"grpc": "127.0.0.1:0"})
    assert "needs an ipc:// frontend" in gateway.cannot_run(tcp_only)
