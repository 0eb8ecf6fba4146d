"""``modelwarden.connect(endpoints)``: a client for one daemon or for several, chosen by how many
endpoints there are.

    import modelwarden
    with modelwarden.connect(["tcp://a:5555", "tcp://b:5555"], server_key=...) as client:
        y = client.infer("mlp", x)

One endpoint (or none: MODELWARDEN_ENDPOINT, MODELWARDEN_CONFIG, the local daemon) gives a
``Client``; several (a list, or commas in the string or in MODELWARDEN_ENDPOINT) give a
``MultiClient`` with the same methods (client/multiclient.py). ``connect_async`` is the same for
``AsyncClient`` and ``AsyncMultiClient``.
"""

from __future__ import annotations

from typing import Any

from modelwarden.client.client import (AsyncClient, Client, _one_endpoint, _several_endpoints,
                                       default_endpoint)


def connect(endpoint: str | list[str] | None = None, **options: Any):
    """A Client for one endpoint, a MultiClient for several; ``options`` are theirs."""
    endpoint = endpoint or default_endpoint()  # found once: discovery checks the file system
    endpoints = _several_endpoints(endpoint)
    if endpoints is None:
        return Client(_one_endpoint(endpoint), **options)
    from modelwarden.client.multiclient import MultiClient

    return MultiClient(endpoints, **options)


def connect_async(endpoint: str | list[str] | None = None, **options: Any):
    """An AsyncClient for one endpoint, an AsyncMultiClient for several."""
    endpoint = endpoint or default_endpoint()
    endpoints = _several_endpoints(endpoint)
    if endpoints is None:
        return AsyncClient(_one_endpoint(endpoint), **options)
    from modelwarden.client.multiclient import AsyncMultiClient

    return AsyncMultiClient(endpoints, **options)
