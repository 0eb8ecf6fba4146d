"""The refusal log's and the worker's map-failure rate limits (an injected clock), and which tcp
endpoints count as exposed."""

import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import zmq

from modelwarden.shared.config import is_exposed_tcp
from modelwarden.supervisor.auth import ZAP_DOMAIN, RefusalLog, ZapHandler
from modelwarden.shared.fdchannel import send_message
from modelwarden.worker.segments import SegmentMaps
from tests.helpers import ROOT


def test_one_report_per_source_per_interval_with_the_count_held_back():
    log = RefusalLog(interval=60.0)
    assert log.due("10.0.0.5", now=100.0) == 1
    assert log.due("10.0.0.5", now=130.0) == 0  # another key from the same address: same source
    assert log.due("10.0.0.6", now=130.0) == 1  # another address is another source
    assert log.due("10.0.0.5", now=159.9) == 0
    assert log.due("10.0.0.5", now=160.0) == 3  # this one and the two held back
    assert log.due("10.0.0.5", now=200.0) == 0
    assert log.due("10.0.0.5", now=300.0) == 2


def test_an_address_scan_does_not_grow_the_log_without_bound():
    log = RefusalLog(interval=60.0)
    for index in range(20_000):
        assert log.due(f"10.0.{index // 256}.{index % 256}", now=index * 0.01) == 1
    assert len(log) <= 6001  # only the sources reported within the last interval remain


def test_an_unmappable_buffer_is_logged_once_a_minute_with_a_count(caplog):
    now = [1000.0]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maps = SegmentMaps(ours, clock=lambda: now[0])
    try:
        def pass_unmappable(count: int) -> None:
            pipes = [os.pipe() for _ in range(count)]  # a pipe cannot be mapped: ENODEV
            send_message(theirs, {"type": "buffers", "tokens": [f"t{now[0]}-{i}" for i in range(count)],
                                  "sizes": [4096] * count}, [read for read, _ in pipes])
            for read, write in pipes:
                os.close(read)
                os.close(write)
            maps.drain()

        with caplog.at_level(logging.ERROR, logger="modelwarden.worker.segments"):
            pass_unmappable(5)
            now[0] += 30.0
            pass_unmappable(5)
            lines = [r.getMessage() for r in caplog.records if "cannot map a buffer" in r.getMessage()]
            assert len(lines) == 1 and "(1 failure(s) since the last report" in lines[0], lines
            now[0] += 30.0
            pass_unmappable(1)
        lines = [r.getMessage() for r in caplog.records if "cannot map a buffer" in r.getMessage()]
        assert len(lines) == 2 and "(10 failure(s) since the last report" in lines[1], lines
        assert len(maps) == 0
    finally:
        ours.close()
        theirs.close()


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


def test_a_worker_maps_client_buffers_only_within_its_budget():
    from modelwarden.shared import shm

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maps = SegmentMaps(ours, budget=3 << 20)
    segments = [shm.create_segment(1 << 20) for _ in range(4)]
    try:
        send_message(theirs, {"type": "buffers", "tokens": ["a", "b", "c", "d"],
                              "sizes": [1 << 20] * 4}, [segment.fd for segment in segments])
        maps.drain()
        assert len(maps) == 3 and maps.mapped == 3 << 20  # the fourth would pass the budget
        with pytest.raises(Exception, match="not passed to this worker"):
            maps.get("d")
        maps.forget(["a"])
        assert maps.mapped == 2 << 20
        send_message(theirs, {"type": "buffers", "tokens": ["d"], "sizes": [1 << 20]},
                     [segments[3].fd])
        maps.drain()
        assert maps.get("d").size == 1 << 20 and maps.mapped == 3 << 20
    finally:
        for segment in segments:
            segment.close()
        ours.close()
        theirs.close()
