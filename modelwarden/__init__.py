"""modelwarden: serve PyTorch models from isolated, pinned, probed worker processes.

The distribution installs one import name, this one. The source tree keeps the roles in
top-level folders (``supervisor/``, ``worker/``, ``client/``, ``gateway/``, ``shared/``) that
install as ``modelwarden.supervisor``, ``modelwarden.worker``, ... (see ``pyproject.toml``), so no
other distribution's ``supervisor`` or ``shared`` can collide with ours.

The client API::

    from modelwarden import Client
    with Client() as client:
        y = client.infer("mlp", torch.randn(8, 64))

    import modelwarden
    with modelwarden.connect(["tcp://a:5555", "tcp://b:5555"]) as client:  # several daemons
        y = client.infer("mlp", torch.randn(8, 64))
"""

from modelwarden.shared import __version__

# The client API is loaded on first use (PEP 562): the client needs torch, the supervisor does
# not, and the daemon imports this package too (``python -m modelwarden``, ``modelwarden.*``).
_EXPORTS = {
    "Client": "modelwarden.client.client", "AsyncClient": "modelwarden.client.client",
    "Reply": "modelwarden.client.client",
    "connect": "modelwarden.client.connect", "connect_async": "modelwarden.client.connect",
    "MultiClient": "modelwarden.client.multiclient",
    "AsyncMultiClient": "modelwarden.client.multiclient",
    **{name: "modelwarden.shared.errors" for name in (
        "RemoteError", "BadRequest", "BadInput", "UnknownModel", "NoWorker", "ModelError",
        "OutOfMemory", "WorkerDied", "Poison", "Timeout", "Overloaded", "ShuttingDown",
        "InternalError", "NoDaemon", "ConnectionLost")},
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelwarden' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
