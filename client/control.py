"""One request on the daemon's control (or admin) socket: what ``modelwarden status``, ``stop``
and ``restart`` send. Light on purpose: zmq and the protocol only, never torch or numpy, so an
operator's ``watch modelwarden status`` costs milliseconds (tests/test_cli.py checks the import
set)."""

from __future__ import annotations

import zmq

from modelwarden.shared import protocol
from modelwarden.shared.errors import Timeout, error_from_reply
from modelwarden.client.ipcaccess import check_ipc_endpoint
from modelwarden.shared.protocol import SIGNATURE, split_reply


def control_request(endpoint: str, header: dict, timeout: float = 5.0) -> dict:
    """Send ``header``, return the reply; raises Timeout if the daemon does not answer, the
    reply's RemoteError if it says no, PermissionError/NoDaemon (ipcaccess) before trying."""
    check_ipc_endpoint(endpoint)  # EACCES or a stale socket now, not a timeout later
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([SIGNATURE, protocol.pack({**header, "id": 1})])
        if not sock.poll(max(0, int(timeout * 1000))):
            raise Timeout(f"no reply from the daemon at {endpoint} within {timeout:.1f}s "
                          "(is it running? is it overloaded?)")
        answer, _ = split_reply(sock.recv_multipart(copy=False))
        if not answer.get("ok"):
            raise error_from_reply(answer)
        return answer
    finally:
        sock.close(0)
        context.term()
