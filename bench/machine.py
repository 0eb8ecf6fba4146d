"""The machine a benchmark ran on and the command that ran it, recorded in each bench's JSON.

Numbers from different machines, or from one machine on a busy and a quiet day, do not compare;
docs/BENCHMARKS.md states, beside each figure, what this records: cores, CPU model, memory,
Python, torch, the date, the load average when the run began, and the commit measured.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def commit_of(root: Path = ROOT) -> str | None:
    """The commit the checkout at ``root`` is at (a worktree's too), and what it has uncommitted."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    if not commit:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.split("\n")
    paths = [line[3:] for line in dirty if line.strip()]
    if not paths:
        return commit
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return f"{commit} with uncommitted changes to {shown}"


def machine(at: str = "start") -> dict:
    """What the figures' captions say about where they were measured; ``at``: whether this is
    recorded as the run begins (its load average says what else ran) or as it ends."""
    import torch  # every bench that records this has torch imported already

    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "recorded_at": at,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit_of(),
    }


def command() -> str:
    """The command line that produced this run, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])
