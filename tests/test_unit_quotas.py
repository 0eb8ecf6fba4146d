"""Unit tests of the shares per identity (supervisor/routing/quotas.py), the registry's byte bounds
(supervisor/routing/buffers.py) and the descriptor account (supervisor/routing/connections.py): no daemon."""

from __future__ import annotations

import os
import socket

import pytest

from modelwarden.shared import shm
from modelwarden.shared.config import DaemonConfig, ModelConfig, Settings
from modelwarden.shared.protocol import BAD_REQUEST, OVERLOADED, ProtocolError
from modelwarden.supervisor.routing import identity
from modelwarden.supervisor.routing.buffers import BufferRegistry, Peer
from modelwarden.supervisor.routing.connections import MAX_FDS_PER_MESSAGE, ConnectionGuard
from modelwarden.supervisor.routing.quotas import Quotas, Shares, default_share, shares_from

SHARES = Shares(connections=2, buffers=3, buffer_bytes=3 << 20, requests=2, request_bytes=100)


def test_a_share_is_taken_within_its_limit_refused_past_it_and_given_back():
    quotas = Quotas(SHARES)
    quotas.take("uid:7", "requests")
    quotas.take("uid:7", "requests")
    with pytest.raises(ProtocolError) as refused:
        quotas.take("uid:7", "requests")
    assert refused.value.code == OVERLOADED
    assert "uid:7 holds 2 requests in flight" in refused.value.message
    assert "max_requests_per_identity (2)" in refused.value.message
    quotas.take("uid:8", "requests")  # another identity has its own share
    quotas.give_back("uid:7", "requests")
    quotas.take("uid:7", "requests")
    for _ in range(2):
        quotas.give_back("uid:7", "requests")
    quotas.give_back("uid:8", "requests")
    assert quotas.held == {} and quotas.view() == []


def test_a_requests_share_is_taken_whole_or_not_at_all_and_given_back_whole():
    quotas = Quotas(SHARES)  # 2 requests, 100 bytes each identity
    quotas.take_request("uid:7", 60)
    with pytest.raises(ProtocolError) as refused:  # the bytes would pass: nothing is taken
        quotas.take_request("uid:7", 41)
    assert refused.value.code == OVERLOADED
    assert "uid:7 holds 60 bytes of requests in flight; 41 more" in refused.value.message
    assert "max_request_bytes_per_identity (100)" in refused.value.message
    assert quotas.holding("uid:7", "requests") == 1 and quotas.holding("uid:7", "request_bytes") == 60
    quotas.take_request("uid:7", 0)
    with pytest.raises(ProtocolError) as refused:  # the count would pass
        quotas.take_request("uid:7", 0)
    assert "uid:7 holds 2 requests in flight" in refused.value.message
    quotas.give_back_request("uid:7", 0)
    quotas.give_back_request("uid:7", 60)
    assert quotas.held == {}
    house = Quotas(SHARES, house="uid:0")
    for _ in range(5):
        house.take_request("uid:0", 100)
    assert house.holding("uid:0", "request_bytes") == 500


def test_the_house_is_bounded_only_by_the_daemon_wide_caps():
    quotas = Quotas(SHARES, house="uid:0")
    for _ in range(10):
        quotas.take("uid:0", "connections")
    assert quotas.allows("uid:0", "connections") and not Quotas(SHARES).allows("uid:0", "connections", 3)
    assert quotas.view() == [{"identity": "uid:0", "connections": 10, "buffers": 0,
                              "buffer_bytes": 0, "requests": 0, "request_bytes": 0}]


def test_default_shares_are_a_fraction_and_never_the_whole_cap():
    assert default_share(1000, 4) == 250 and default_share(3, 4) == 1 and default_share(2, 2) == 1
    assert default_share(1, 4) == 1
    settings = Settings(daemon=DaemonConfig(max_request_bytes=4000, max_buffer_bytes=8 << 20),
                        models=[ModelConfig(name="a", source="python:m:f", warmup=0, max_queue=100),
                                ModelConfig(name="b", source="python:m:f", warmup=0, max_queue=10)])
    shares = shares_from(settings, connections=400, buffers=16384)
    assert shares == Shares(connections=100, buffers=4096, buffer_bytes=2 << 20, requests=5,
                            request_bytes=1000)
    configured = Settings(daemon=DaemonConfig(max_requests_per_identity=7,
                                              max_connections_per_identity=3))
    assert shares_from(configured, 400, 16384).requests == 7
    assert shares_from(configured, 400, 16384).connections == 3


def sealed(size: int) -> int:
    return shm.create_segment(size).fd


def sparse(size: int) -> int:
    """A sealed memfd of ``size`` bytes that commits no memory (nothing written)."""
    import fcntl

    fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_registered_bytes_are_bounded_per_identity_and_in_all_by_size_not_count():
    quotas = Quotas(SHARES)
    registry = BufferRegistry(max_bytes=5 << 20, quotas=quotas)
    first, second = Peer(1, 1001, 0), Peer(2, 1002, 0)
    huge = sparse(1 << 40)  # a 1 TiB sparse memfd costs its sender nothing
    with pytest.raises(ProtocolError) as whole:
        registry.register(first, [huge])
    assert whole.value.code == BAD_REQUEST and "max_buffer_bytes_per_identity" in whole.value.message
    os.close(huge)
    registry.register(first, [sealed(1 << 20), sealed(1 << 20)])
    spare = sealed(2 << 20)
    with pytest.raises(ProtocolError) as share:
        registry.register(first, [spare])
    assert share.value.code == OVERLOADED and "max_buffer_bytes_per_identity" in share.value.message
    registry.register(second, [sealed(2 << 20)])
    with pytest.raises(ProtocolError) as in_all:
        registry.register(second, [spare])
    assert in_all.value.code == OVERLOADED and "max_buffer_bytes (5242880)" in in_all.value.message
    assert registry.bytes == 4 << 20 and quotas.holding("uid:1001", "buffer_bytes") == 2 << 20
    registry.drop(first)
    registry.register(first, [spare])  # what the first gave back fits now
    registry.close()
    assert registry.bytes == 0 and quotas.held == {}


def test_the_guard_refuses_descriptors_under_the_reserve_and_pauses_every_listener():
    class Raw:
        endpoint, paused = "raw", False

        def pause(self):
            self.paused = True

        def resume(self):
            self.paused = False

    fds = {"open": 100}
    guard = ConnectionGuard(fd_limit=1000, max_connections=None, count_fds=lambda: fds["open"])
    raw = Raw()
    guard.add_listener(raw)
    guard.start(worker_slots=1)
    assert guard.reserve >= MAX_FDS_PER_MESSAGE
    room = 1000 - 100 - guard.reserve
    assert guard.can_take(room) and not guard.can_take(room + 1)
    guard.charge(room - 1)
    assert not guard.paused and guard.can_accept()
    guard.charge(2)  # one past the mark: every listener pauses at once
    assert guard.paused and raw.paused and not guard.can_take() and not guard.can_accept()
    guard.refund(room + 1)
    guard._decide()
    assert not guard.paused and not raw.paused


def test_a_connection_over_its_identitys_share_is_shut_by_the_guard():
    quotas = Quotas(Shares(connections=1, buffers=1, buffer_bytes=1, requests=1, request_bytes=1))
    guard = ConnectionGuard(fd_limit=1 << 16, max_connections=None, quotas=quotas)
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        ours = [pair[0] for pair in pairs]
        uid = identity.uid_identity(os.getuid())
        guard._accepted(None, ours[0].fileno())
        guard._accepted(None, ours[1].fileno())
        assert quotas.holding(uid, "connections") == 2  # counted until disconnected
        with pytest.raises(BlockingIOError):
            pairs[0][1].recv(1, socket.MSG_DONTWAIT)  # within the share: left alone
        assert pairs[1][1].recv(1) == b""  # over it: shut down, the peer sees the end
        guard._disconnected(None, ours[1].fileno())
        guard._disconnected(None, ours[0].fileno())
        assert quotas.held == {} and guard.connections == 0
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


def test_identities_come_from_the_kernels_credentials():
    # The message property shared/sockets.recv_routed returns ("" when the transport has none).
    assert identity.property_of(identity.IPC) == identity.property_of(identity.TCP) == "Peer-Address"
    assert identity.property_of(identity.CURVE) == "User-Id"
    assert identity.of_property("localhost:1001:1001:4070", identity.IPC) == "uid:1001"
    assert identity.of_property("fe80::1:2:3", identity.TCP) == "addr:fe80::1:2:3"
    assert identity.of_property("key:alice", identity.CURVE) == "key:alice"
    assert identity.of_property("", identity.CURVE) == identity.UNKNOWN
    left, right = socket.socketpair()
    with left, right:
        assert identity.of_descriptor(left.fileno()) == f"uid:{os.getuid()}"
        left.fileno()  # of_descriptor detached: still open
