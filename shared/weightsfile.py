"""Where a model's ``weights_file`` is, found the same way by the supervisor (to version it) and
by the worker (to map it), without importing anything.

  ``PATH``              relative to the configuration file's directory (or absolute)
  ``package:NAME/PATH`` a file inside the installed top-level package NAME (a package that ships
                        weights, e.g. the ``examples`` extra's all-MiniLM-L6-v2), found on the
                        daemon's ``python_path`` then the interpreter's own paths (never
                        the working directory: shared/syspath.py)
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path
from typing import Iterable

from modelwarden.shared.syspath import interpreter_paths

PACKAGE_PREFIX = "package:"


class WeightsFileError(ValueError):
    """The weights file's package is not installed."""


def resolve_weights_file(value: str, base_dir: Path, python_path: Iterable[str] = ()) -> Path:
    if not value.startswith(PACKAGE_PREFIX):
        path = Path(value).expanduser()
        return path if path.is_absolute() else Path(base_dir) / path
    package, _, inner = value[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.machinery.PathFinder.find_spec(package, [*python_path, *interpreter_paths()])
    if spec is None or not spec.submodule_search_locations:
        raise WeightsFileError(f"weights_file {value!r}: package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / inner
