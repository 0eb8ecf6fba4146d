"""The kernel's cpu-list format, shared by the planner, the worker and ``modelwarden status``."""

from __future__ import annotations


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's cpu-list format)."""
    parts, start, prev = [], None, None
    for core in sorted(cores):
        if start is None:
            start = prev = core
        elif core == prev + 1:
            prev = core
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = core
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)
