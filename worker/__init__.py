"""One worker process: placement, model loading, the serving loop."""

from modelwarden.shared import refuse_bare_import

refuse_bare_import(__name__, "modelwarden.worker")
