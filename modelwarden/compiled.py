"""Which request path this process runs: the modules setup.py compiles, compiled or not.

``report()`` maps each module of ``compiled_modules.COMPILED`` to one of:

- ``compiled``: imported from its C extension, built from the source beside it;
- ``stale``: imported from a C extension built from an older version of its source (edit a
  module, forget ``make install``): the code running is not the code you read;
- ``uncompiled``: imported from its ``.py`` (no compiler at build time, ``MODELWARDEN_PURE=1``,
  or a copy of the tree without the ``.so`` files).

The daemon logs the summary at start (``request path: ...``), a stale module as a WARNING.
``python -m modelwarden.compiled`` prints the report and exits 1 unless every module is
compiled and fresh (``--allow-uncompiled``: exit 0 for an uncompiled build).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

from modelwarden.compiled_modules import COMPILED, source_hash

COMPILED_STATE, STALE, UNCOMPILED = "compiled", "stale", "uncompiled"
MANIFEST = Path(__file__).with_name("_compiled.json")  # written by setup.py's build_ext


def _is_extension(path: str | None) -> bool:
    return bool(path) and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _origin(name: str) -> str | None:
    """The file an import of ``name`` loads, found without importing it: the supervisor asks,
    and several of these modules import torch, which the supervisor never loads."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None else None


def report() -> dict[str, str]:
    built = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    states = {}
    for name in COMPILED:
        origin = _origin(name)
        if not _is_extension(origin):
            states[name] = UNCOMPILED
            continue
        # The .py beside the extension (the editable tree, or the wheel's copy).
        source = Path(origin).parent / (name.rpartition(".")[2] + ".py")
        fresh = source.exists() and name in built and source_hash(source) == built[name]
        states[name] = COMPILED_STATE if fresh else STALE
    return states


def summary(states: dict[str, str] | None = None) -> str:
    """One line for the start-up log."""
    states = report() if states is None else states
    counts = {state: sum(1 for value in states.values() if value == state)
              for state in (COMPILED_STATE, STALE, UNCOMPILED)}
    if counts[COMPILED_STATE] == len(states):
        return f"request path: compiled ({len(states)} modules, Cython)"
    parts = [f"{counts[state]} {state}" for state in (COMPILED_STATE, STALE, UNCOMPILED) if counts[state]]
    odd = sorted(name.rpartition(".")[2] for name, state in states.items() if state != COMPILED_STATE)
    return f"request path: {', '.join(parts)} of {len(states)} modules (not compiled: {', '.join(odd)})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    states = report()
    for name, state in states.items():
        print(f"{state:10s} {name}")
    print(summary(states))
    wanted = {COMPILED_STATE, UNCOMPILED} if "--allow-uncompiled" in argv else {COMPILED_STATE}
    return 0 if set(states.values()) <= wanted else 1


if __name__ == "__main__":
    sys.exit(main())
