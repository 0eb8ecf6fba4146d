"""Model versions: which build of a model a worker runs, computed by the supervisor.

A model's ``version`` is the configured string when there is one. Otherwise it is derived from
what the worker will load, without importing it (the supervisor never imports torch or the
model's code): the first 12 hex digits of a SHA-256 over

  * the model file's bytes, for ``torchscript:PATH`` and ``export:PATH``;
  * the factory module's source file, for ``python:module:callable`` (found on the path the
    worker's ``sys.path`` is set to, shared/syspath.py: ``python_path`` then the interpreter's
    own, never the daemon's working directory; ``a/b.py`` or ``a/b/__init__.py``; a module with
    no source file found hashes its name);
  * the ``weights_file``'s bytes, when one is set;
  * and the model's ``kwargs``, which change what the factory builds as much as its code does.

New weights put in place therefore make a new version at the next spawn (``modelwarden restart``)
or reload, and a new version never inherits the golden probe output of the old one
(supervisor/fleet/probes.py keeps one golden per version). An operator who sets ``version`` by hand
must change it with the weights.

Hashing a large model file takes a while, so each file's digest is kept and computed again only
when the file's size, mtime or inode changes: a spawn costs one ``stat``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable

from modelwarden.shared.config import ModelConfig
from modelwarden.shared.weightsfile import WeightsFileError, resolve_weights_file

logger = logging.getLogger(__name__)
DIGITS = 12
CHUNK = 1 << 20


class VersionBook:
    """Versions of models, with file digests kept by (path, size, mtime, inode)."""

    def __init__(self, base_dir: Path, python_path: Iterable[str]) -> None:
        self.base_dir = base_dir
        self.python_path = list(python_path)
        self._digests: dict[Path, tuple[tuple, str]] = {}

    def of(self, model: ModelConfig) -> str:
        if model.version is not None:
            return model.version
        digest = hashlib.sha256(model.source.encode())
        path = self.source_file(model.source)
        digest.update(self._file_digest(path).encode() if path is not None else b"no source file")
        if model.weights_file is not None:
            digest.update(self._weights_digest(model.weights_file).encode())
        digest.update(json.dumps(model.kwargs, sort_keys=True, default=str).encode())
        return digest.hexdigest()[:DIGITS]

    def source_file(self, source: str) -> Path | None:
        scheme, _, rest = source.partition(":")
        if scheme in ("torchscript", "export"):
            path = Path(rest).expanduser()
            return path if path.is_absolute() else self.base_dir / path
        module = rest.partition(":")[0]
        return find_module_file(module, self.python_path)  # the worker's whole sys.path

    def _weights_digest(self, weights_file: str) -> str:
        try:
            return self._file_digest(resolve_weights_file(weights_file, self.base_dir, self.python_path))
        except WeightsFileError:
            return "missing"

    def _file_digest(self, path: Path) -> str:
        try:
            stat = path.stat()
        except OSError:
            return "missing"
        key = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        known = self._digests.get(path)
        if known is not None and known[0] == key:
            return known[1]
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            logger.warning("cannot read %s to version it: %s", path, exc)
            return "unreadable"
        self._digests[path] = (key, digest.hexdigest())
        return digest.hexdigest()


def find_module_file(module: str, roots: Iterable[str]) -> Path | None:
    """Where ``import module`` would find its source, looking only at files (nothing imported)."""
    parts = module.split(".")
    for root in roots:
        base = Path(root or os.getcwd()).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None
