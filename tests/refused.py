"""A client whose CURVE handshake the daemon refuses, run as its own process by
tests/test_curve.py, so that a client that waits for ever fails the test by a timeout instead of
hanging it.

libzmq does not reconnect after a refused handshake: the DEALER is left with no pipe, and a
blocking send on it never returns (client/connection.py). The script makes a refused request,
waits until libzmq has given the socket up (it takes no more messages), makes a second one (both
must end in Timeout at their deadline), prints ``{"refused": [...]}``, then waits for a line on
stdin (the test has allowed the key and the daemon reread its keys) and makes a third, which the
same client object must get answered over a new connection: ``{"allowed": ...}``.

    python -m tests.refused KIND ENDPOINT SERVER_KEY CLIENT_KEY MODEL
    KIND: infer (Client.infer), submit (Client.submit), async (AsyncClient), several (connect)
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import zmq

from modelwarden.testing import poll_until

REFUSED_TIMEOUT_S = 1.0


def given_up(socket: zmq.Socket) -> bool:
    return not socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT


def wait_given_up(sockets) -> None:
    poll_until(lambda: all(given_up(socket) for socket in sockets()), 30,
               message="libzmq to give up the refused connection (else nothing here to test)")


def outcome(call) -> str:
    try:
        call()
        return "ok"
    except Exception as exc:  # the type is the outcome
        return type(exc).__name__


def main() -> None:
    kind, endpoint, server_key, client_key, model = sys.argv[1:6]
    x = torch.randn(8, 64)
    keys = {"server_key": server_key, "client_key": client_key}
    if kind == "async":
        run_async(endpoint, keys, model, x)
        return
    if kind == "several":
        from modelwarden.client.connect import connect

        # The same daemon twice (two names for it): a MultiClient, both links refused.
        endpoints = [endpoint, endpoint.replace("127.0.0.1", "localhost")]
        client = connect(endpoints, timeout=REFUSED_TIMEOUT_S, **keys)
        sockets = lambda: [link.socket for link in client._io.links.values()]
        call = lambda timeout: client.infer(model, x, timeout=timeout)
    else:
        from modelwarden import Client

        client = Client(endpoint, timeout=REFUSED_TIMEOUT_S, **keys)
        if kind == "infer":
            sockets = lambda: [client._local.connection.socket]
            call = lambda timeout: client.infer(model, x, timeout=timeout)
        else:
            client.hello = lambda: None  # submit asks hello() first: test submit's own socket
            sockets = lambda: [client._io.connection.socket]
            call = lambda timeout: client.submit(model, x, timeout=timeout).result()
    refused = [outcome(lambda: call(REFUSED_TIMEOUT_S))]
    wait_given_up(sockets)
    refused.append(outcome(lambda: call(REFUSED_TIMEOUT_S)))
    print(json.dumps({"refused": refused}), flush=True)
    sys.stdin.readline()
    client.timeout = 30.0
    print(json.dumps({"allowed": outcome(lambda: call(30.0))}), flush=True)
    client.close()


def run_async(endpoint: str, keys: dict, model: str, x: torch.Tensor) -> None:
    from modelwarden import AsyncClient

    async def scenario() -> None:
        client = AsyncClient(endpoint, timeout=REFUSED_TIMEOUT_S, **keys)

        async def call(timeout: float) -> str:
            try:
                await client.infer(model, x, timeout=timeout)
                return "ok"
            except Exception as exc:
                return type(exc).__name__

        refused = [await call(REFUSED_TIMEOUT_S)]
        wait_given_up(lambda: [client._socket])
        refused.append(await call(REFUSED_TIMEOUT_S))
        print(json.dumps({"refused": refused}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        client.timeout = 30.0
        print(json.dumps({"allowed": await call(30.0)}), flush=True)
        await client.close()

    asyncio.run(scenario())


if __name__ == "__main__":
    main()
