"""One model's request state, kept by the router as the Majordomo broker keeps a ``Service``:
the requests waiting for it, its batches, the partial batch it holds back, and whether its
workers freed up this round. Its workers are the fleet's (supervisor/fleet/pool.py): the router
asks the pool which one has room.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelwarden.supervisor.routing.batching import BatchStats

if TYPE_CHECKING:
    from modelwarden.supervisor.fleet.pool import ModelPool


@dataclass(eq=False)
class ModelService:
    name: str
    queue: collections.deque = field(default_factory=collections.deque)  # FIFO, retries first
    batches: BatchStats = field(default_factory=BatchStats)  # how full its forward passes were
    hold: Any = None  # the timer that sends its held partial batch (batching.hold_until)
    wanted: "ModelPool | None" = None  # its workers freed up this round: dispatch it


class Services(dict):
    """Model name -> its ModelService, made on first use."""

    def __missing__(self, name: str) -> ModelService:
        service = self[name] = ModelService(name)
        return service
