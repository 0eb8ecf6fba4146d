"""Do the CUDA devices a configuration names exist here? Asked by ``serve --check``, without
importing torch (the supervisor never does): the NVIDIA driver's own view of the machine.

A GPU exists for the driver when ``/proc/driver/nvidia/gpus/`` has an entry for it (one folder
per board) or, failing that, a ``/dev/nvidiaN`` node. ``cuda:N`` needs N+1 of them (or N+1 entries
in ``CUDA_VISIBLE_DEVICES`` when that is set, since CUDA renumbers what it lists); ``cuda`` needs
one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")


def visible_gpus() -> int:
    """How many CUDA devices a worker started now could use."""
    count = _driver_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [item for item in visible.split(",") if item.strip() and item.strip() != "-1"]
        count = min(count, len(listed))
    return count


def _driver_gpus() -> int:
    try:
        return sum(1 for _ in PROC_GPUS.iterdir())
    except OSError:
        pass
    try:
        return sum(1 for entry in DEV.iterdir() if re.fullmatch(r"nvidia[0-9]+", entry.name))
    except OSError:
        return 0


def missing_devices(devices: list[str]) -> list[str]:
    """The configured devices (``cpu``, ``cuda``, ``cuda:N``) this machine lacks."""
    count = visible_gpus()
    missing = []
    for device in dict.fromkeys(devices):
        if device == "cpu":
            continue
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            missing.append(device)
    return missing
