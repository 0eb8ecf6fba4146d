"""The compiled request path: Cython compiles these modules in its pure-Python mode.

They are the ordinary ``.py`` files the rest of the tree imports, one implementation of each
rule: compiled, each becomes a C extension module that Python imports instead of the ``.py``
beside it (an extension module is found first); uncompiled (no compiler, ``MODELWARDEN_PURE=1``,
or a test's copy of the tree without the ``.so`` files) the very same files run as they are.
docs/ARCHITECTURE.md ("The compiled request path") says which rules live where and why Cython.

Everything else about the package is pyproject.toml's. A build that cannot compile (no C
compiler: an sdist on a bare machine) says so in one line per module and installs the
uncompiled path; ``modelwarden.compiled.report()`` and the daemon's start-up log tell which
one a process runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "modelwarden"))
from compiled_modules import COMPILED, source_hash  # noqa: E402  (standard library only: no import of us)

sys.path.pop(0)
# Keep Python's semantics exactly: annotations are documentation here, never C types that
# would turn a duck-typed argument into a TypeError; functions stay introspectable.
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True,
              "embedsignature": True}
MANIFEST = "modelwarden/_compiled.json"  # module -> sha256 of the source it was compiled from


class OptionalBuildExt(build_ext):
    """Compiles what it can; a module that cannot be compiled runs uncompiled, said once."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises its own kinds)
            print(f"modelwarden: the request path stays uncompiled: {exc}", file=sys.stderr)
        self._write_manifest()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"modelwarden: {ext.name} stays uncompiled: {exc}", file=sys.stderr)

    def _write_manifest(self) -> None:
        """Beside the extensions this build leaves: the source tree (in place, or an editable
        install) or the build tree (a wheel), never both: a wheel's build must not vouch for
        the tree's own, possibly older, extensions."""
        built = {}
        for ext in self.extensions:
            if Path(self.get_ext_fullpath(ext.name)).exists():
                built[ext.name] = source_hash(ROOT / COMPILED[ext.name])
        in_tree = self.inplace or getattr(self, "editable_mode", False)
        target = (ROOT if in_tree else Path(self.build_lib)) / MANIFEST
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(built, indent=1, sort_keys=True) + "\n")


def extensions() -> list[Extension]:
    if os.environ.get("MODELWARDEN_PURE") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("modelwarden: Cython is not installed; the request path stays uncompiled",
              file=sys.stderr)
        return []
    modules = [Extension(name, [path]) for name, path in COMPILED.items()]
    return cythonize(modules, compiler_directives=DIRECTIVES, quiet=True,
                     include_path=[str(declarations_tree())])


def declarations_tree() -> Path:
    """Cython finds a module's .pxd by the module's dotted name (modelwarden/shared/sockets.pxd),
    but the role folders are mapped to the package (pyproject.toml), so the tree has no such
    path: link each .pxd beside its .py into one under build/ that has it."""
    tree = ROOT / "build" / "pxd"
    for name, path in COMPILED.items():
        declarations = (ROOT / path).with_suffix(".pxd")
        if declarations.exists():
            target = tree.joinpath(*name.split(".")).with_suffix(".pxd")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            target.symlink_to(declarations)
    return tree


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
