"""Unit tests of the buffer registry (supervisor/routing/buffers.py) and the channel framing
(shared/fdchannel.py): real memfds and a real socket pair, no daemon."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from modelwarden.shared import fdchannel, protocol, shm
from modelwarden.shared.protocol import BAD_REQUEST, BUFFER_NOT_REGISTERED, ProtocolError
from modelwarden.supervisor.routing.buffers import BufferRegistry, Peer


def sealed(size: int = 65536) -> int:
    return shm.create_segment(size).fd


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_register_answers_one_fresh_token_per_descriptor_and_owns_them():
    registry, peer = BufferRegistry(), Peer(1, 2, 3)
    fds = [sealed(), sealed(1 << 20)]
    tokens = registry.register(peer, fds)
    assert len(set(tokens)) == 2 and all(protocol.TOKEN_RE.fullmatch(t) for t in tokens)
    assert [registry.get(t).size for t in tokens] == [65536, 1 << 20]
    assert sorted(registry.drop(peer)) == sorted(tokens) and len(registry) == 0
    for fd in fds:  # revoking closed both descriptors
        with pytest.raises(OSError):
            os.fstat(fd)


def test_an_unsealed_memfd_spoils_the_whole_message_and_the_caller_keeps_the_fds():
    registry, peer = BufferRegistry(), Peer(1, 2, 3)
    loose = os.memfd_create("modelwarden", os.MFD_ALLOW_SEALING)
    os.ftruncate(loose, 4096)
    good = sealed()
    with pytest.raises(ProtocolError) as info:
        registry.register(peer, [good, loose])
    assert info.value.code == BAD_REQUEST and len(registry) == 0 and not peer.tokens
    os.fstat(good), os.fstat(loose)  # still open: the caller closes them
    fcntl.fcntl(loose, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    assert len(registry.register(peer, [good, loose])) == 2
    registry.close()


def test_limits_per_connection_and_in_all():
    registry = BufferRegistry(per_connection=2, total=3)
    first, second = Peer(1, 0, 0), Peer(2, 0, 0)
    refused = [sealed(), sealed()]  # a refused caller keeps its descriptors: closed below
    registry.register(first, [sealed(), sealed()])
    with pytest.raises(ProtocolError):
        registry.register(first, refused[:1])
    registry.register(second, [sealed()])
    with pytest.raises(ProtocolError):
        registry.register(second, refused[1:])  # the daemon-wide cap
    registry.close()
    for fd in refused:
        os.close(fd)


def test_check_refuses_unknown_tokens_and_regions_outside_without_echoing_the_token():
    registry, peer = BufferRegistry(), Peer(1, 2, 3)
    (token,) = registry.register(peer, [sealed()])
    registry.check((token, 0, 65536), "x")
    registry.check((token, 65536, 0), "x")
    for region in [(token, 1, 65536), (token, 65537, 0), (token, 2**63, 2**63)]:
        with pytest.raises(ProtocolError) as info:
            registry.check(region, "tensor 0")
        assert token not in info.value.message and info.value.detail is None
    guess = "f" * 32
    with pytest.raises(ProtocolError) as info:
        registry.check((guess, 0, 1), "tensor 0")
    assert info.value.detail == BUFFER_NOT_REGISTERED and guess not in info.value.message
    registry.unregister(Peer(9, 9, 9), [token])  # not its registrant: ignored
    registry.check((token, 0, 1), "x")
    registry.unregister(peer, [token])
    with pytest.raises(ProtocolError):
        registry.check((token, 0, 1), "x")
    assert len(registry) == 0


def test_framing_round_trip_and_truncation_closes_what_came():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        fd = sealed()
        fdchannel.send_message(left, {"type": "register", "id": 1}, [fd])
        message, fds = fdchannel.receive_message(right)
        assert message == {"type": "register", "id": 1} and len(fds) == 1
        assert os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino
        fdchannel.close_all(fds)
        before = open_fds()
        socket.send_fds(left, [b"\x80"], [fd] * (fdchannel.MAX_FDS_PER_MESSAGE + 1))
        with pytest.raises(ProtocolError):
            fdchannel.receive_message(right)
        assert open_fds() == before  # none of the received copies is left open
        left.close()
        with pytest.raises(fdchannel.ChannelClosed):
            fdchannel.receive_message(right)
        os.close(fd)
    finally:
        right.close()
