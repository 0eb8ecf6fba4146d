"""One model's request state, kept by the router as the Majordomo broker keeps a ``Service``:
the requests waiting for it, its batches, the partial batch it holds back, and whether its
workers freed up this round. Its workers are the fleet's (supervisor/fleet/pool.py): the router
asks the pool which one has room.

It also keeps, as plain fields, the few settings of the model that every request reads (its
queue bound, its timeout, its batching), copied from the pool's ``ModelConfig`` whenever that
object is replaced (a reload): a request reads a C field instead of walking three pydantic
objects. Compiled, an extension type (service.pxd).
"""

from __future__ import annotations

import collections

from modelwarden.supervisor.routing.batching import BatchStats


class ModelService:
    def __init__(self, name):
        self.name = name
        self.queue = collections.deque()  # FIFO, retries first
        self.batches = BatchStats()  # how full its forward passes were
        self.hold = None  # the timer that sends its held partial batch (batching.hold_until)
        self.wanted = None  # the ModelPool whose workers freed up this round: dispatch it
        self.config = None  # the ModelConfig the fields below were copied from
        self.max_queue = 0
        self.timeout = 0.0
        self.max_inflight = 1
        self.inputs = None  # the declared inputs, or None
        self.batching = None  # its BatchingConfig
        self.batch_enabled = False
        self.max_delay_us = 0
        self.handler = False  # its source is a handler: batched by what the header shows
        self.probes = False  # its workers are probed (interval and an input)

    def follow(self, config):
        """Copy what each request reads from ``config`` unless it is the one copied already."""
        if config is self.config:
            return
        self.config = config
        self.max_queue = config.max_queue
        self.timeout = config.timeout
        self.max_inflight = config.max_inflight
        self.inputs = config.inputs or None
        self.batching = config.batching
        self.batch_enabled = config.batching.enabled
        self.max_delay_us = config.batching.max_delay_us
        self.handler = config.source.startswith("handler:")
        self.probes = config.probes_enabled
