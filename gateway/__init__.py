"""The KServe v2 (Open Inference Protocol) gateway: its own process, a client of the daemon."""

from modelwarden.shared import refuse_bare_import

refuse_bare_import(__name__, "modelwarden.gateway")
