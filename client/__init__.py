"""The modelwarden client: everything a program needs to talk to the daemon, and nothing of it.

``client`` (Client, AsyncClient, Reply), ``connect`` (one daemon or several), ``multiclient``
(several daemons), ``balancer`` (which daemon gets a request), ``session`` (request building and
reply decoding), ``curve`` (a client's CURVE keys), ``control`` (one request on the control or
admin socket: light, no torch), ``ipcaccess`` (can this process reach an ipc endpoint).

It stands on ``modelwarden.shared`` (the wire) and never imports the supervisor. This file
imports nothing heavy, so ``modelwarden.client.control`` stays as light as it is.
"""

from modelwarden.shared import refuse_bare_import

refuse_bare_import(__name__, "modelwarden.client")
