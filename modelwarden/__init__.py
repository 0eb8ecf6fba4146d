"""modelwarden: serve PyTorch models from isolated, pinned, probed worker processes.

The distribution installs one import name, this one. The source tree keeps the roles in
top-level folders (``supervisor/``, ``worker/``, ``shared/``) that install as
``modelwarden.supervisor``, ``modelwarden.worker`` and ``modelwarden.shared`` (see
``pyproject.toml``), so no other distribution's ``supervisor`` or ``shared`` can collide with ours.

The client API::

    from modelwarden import Client
    with Client() as client:
        y = client.infer("mlp", torch.randn(8, 64))
"""

from modelwarden.shared import __version__
from modelwarden.shared.client import AsyncClient, Client, Reply
from modelwarden.shared.errors import (BadInput, BadRequest, InternalError, ModelError, NoWorker,
                                       OutOfMemory, Overloaded, Poison, RemoteError, ShuttingDown,
                                       Timeout, UnknownModel, WorkerDied)

__all__ = ["__version__", "Client", "AsyncClient", "Reply", "RemoteError", "BadRequest", "BadInput",
           "UnknownModel", "NoWorker", "ModelError", "OutOfMemory", "WorkerDied", "Poison",
           "Timeout", "Overloaded", "ShuttingDown", "InternalError"]
