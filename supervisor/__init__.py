"""The modelwarden daemon: one poll loop supervising pinned, probed worker processes.

The core, here: ``arbiter`` (the loop, its sockets, signals, spawning and reaping), ``commands``
(control commands, through ``CommandHost``), ``status``, ``runtime`` (the runtime directory),
``systemd``, ``timers``, ``auth`` (CURVE and its ZAP handler), ``metrics`` and ``metrics_http``,
``gatewaykeeper`` (the gateway process), ``accesslog``. Two wings: ``routing/`` (the request
path) and ``fleet/`` (the workers).
"""

from modelwarden.shared import refuse_bare_import

refuse_bare_import(__name__, "modelwarden.supervisor")
