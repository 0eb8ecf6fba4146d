"""The refusal log's rate limit (an injected clock) and which tcp endpoints count as exposed."""

import logging
import shutil
import subprocess
import sys
import time

import pytest
import zmq

from modelwarden.shared.config import is_exposed_tcp
from modelwarden.supervisor.auth import ZAP_DOMAIN, RefusalLog, ZapHandler
from tests.helpers import ROOT


def test_one_report_per_peer_per_interval():
    log = RefusalLog(interval=60.0)
    peer, other = ("10.0.0.5", "keyA"), ("10.0.0.5", "keyB")
    assert log.due(peer, now=100.0)
    assert not log.due(peer, now=130.0)
    assert log.due(other, now=130.0)  # the same address with another key is another peer
    assert not log.due(peer, now=159.9)
    assert log.due(peer, now=160.0)
    assert not log.due(peer, now=200.0)


def test_a_key_scan_does_not_grow_the_log_without_bound():
    log = RefusalLog(interval=60.0)
    for index in range(20_000):
        assert log.due(("10.0.0.5", f"key{index}"), now=index * 0.01)
    assert len(log._last) <= 6001  # only the peers seen within the last interval remain


@pytest.mark.parametrize("endpoint, exposed", [
    ("tcp://127.0.0.1:5555", False), ("tcp://127.200.1.1:5555", False),
    ("tcp://localhost:5555", False), ("tcp://[::1]:5555", False),
    ("tcp://0.0.0.0:5555", True), ("tcp://*:5555", True), ("tcp://192.168.1.4:5555", True),
    ("tcp://eth0:5555", True), ("tcp://example.com:5555", True), ("ipc:///run/x.sock", False)])
def test_exposed_tcp(endpoint, exposed):
    assert is_exposed_tcp(endpoint) is exposed


def test_a_failed_reload_keeps_the_keys_in_force(tmp_path, caplog):
    subprocess.run([sys.executable, "-m", "modelwarden", "keygen", str(tmp_path / "a"), "--name", "a"],
                   cwd=ROOT, check=True, capture_output=True, timeout=60)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(tmp_path / "a" / "a.key", allowed)
    context = zmq.Context()
    handler = ZapHandler(context, allowed, time.monotonic)
    try:
        handler.start()
        (allowed / "broken.key").write_text("no key here\n")
        with caplog.at_level(logging.INFO, logger="modelwarden.supervisor.auth"):
            handler.reload()
        assert len(handler.certs[ZAP_DOMAIN]) == 1
        assert any(record.levelname == "ERROR" and "broken.key" in record.getMessage()
                   and "1 key(s) read before stay allowed" in record.getMessage()
                   for record in caplog.records)
    finally:
        handler.stop()
        context.term()
