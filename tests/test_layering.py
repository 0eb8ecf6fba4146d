"""The package's floors: what each folder may import.

    shared/      the wire and common core: imports nothing of ours but modelwarden.shared
    client/      the client            \\
    worker/      one model's process    > never import the supervisor
    gateway/     the KServe v2 process /  (and the gateway never imports the worker)
    supervisor/  the daemon (with its sub-folders)
    modelwarden/ the top: the CLI, the public names, the harness; may import any floor

and nothing in the package imports a folder of the repository by its bare name (``tests``,
``bench``, ``supervisor``...): those are not what gets installed, so such an import works in a
checkout and fails, or finds another project on PyPI, once installed.

Every ``.py`` file under each ``[tool.setuptools.package-dir]`` folder of pyproject.toml is
parsed with ``ast``, so a new folder there is covered without touching this file. Every import
counts: at module level, inside functions, under ``if TYPE_CHECKING:`` (a type-only import is
still a dependency on that floor), relative ones, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name. A name computed at run time cannot be checked (the
top package's lazy exports, the worker loading a user's model).

One exception, decided here: shared may write ``from modelwarden import __version__``. The top
package's ``__init__`` imports only ``modelwarden.shared`` when imported (its client names load on
first use), and its ``__version__`` is shared's; any other name from the top package is a
violation. ``modelwarden.shared.__version__`` is the better spelling.

Each rule is its own test, so one floor's known break does not hide a new one on another floor
(bench/mutants.py's ``layering-*`` mutations rely on that).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = "modelwarden"
TOP = "top"  # the layer of modelwarden/ itself and of any module not in a sub-package of ours
REPOSITORY_FOLDER = "repository folder"  # a bare top-level folder name: not what is installed


@dataclass(frozen=True)
class Rule:
    name: str
    importers: frozenset[str] | None  # the layers it binds; None: every layer
    forbidden: frozenset[str] | None  # the target layers it forbids; None: all of ours but shared
    says: str


RULES = [
    Rule("shared-imports-only-shared", frozenset({"shared"}), None,
         "shared imports nothing of ours above it"),
    *(Rule(f"{layer}-never-imports-supervisor", frozenset({layer}), frozenset({"supervisor"}),
           f"the {layer} never imports the supervisor") for layer in ("worker", "client", "gateway")),
    Rule("gateway-never-imports-worker", frozenset({"gateway"}), frozenset({"worker"}),
         "the gateway never imports the worker"),
    Rule("no-repository-folder-by-bare-name", None, frozenset({REPOSITORY_FOLDER}),
         "the package never imports tests/, bench/ or another folder by its bare name"),
]


@dataclass(frozen=True)
class Import:
    path: Path  # relative to the root
    line: int
    module: str  # the importing module's dotted name
    target: str  # the imported module's absolute dotted name
    names: tuple[str, ...] = ()  # ``from target import names``, when target is not a sub-package


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    target: str
    rule: Rule

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target} ({self.rule.says})"


class Layout:
    """pyproject.toml's package-dir mapping: which folder installs as which package, the layer
    of a module name, and which bare names are folders of the repository."""

    def __init__(self, root: Path) -> None:
        self.root = root = root.resolve()
        pyproject = tomllib.loads((root / "pyproject.toml").read_text())
        mapping = pyproject["tool"]["setuptools"]["package-dir"]
        self.folders = {package: (root / folder).resolve() for package, folder in mapping.items()}
        self.packages = set(mapping)
        self.bare = {entry.name for entry in root.iterdir()
                     if entry.is_dir() and not entry.name.startswith((".", "_")) and entry.name != PACKAGE}
        self.files = self._files()
        self.modules = set(self.files.values())

    def _files(self) -> dict[Path, str]:
        """Every .py file of the package -> its module name (its deepest mapped folder decides)."""
        found: dict[Path, str] = {}
        for package, folder in sorted(self.folders.items(), key=lambda item: len(str(item[1]))):
            for directory, subdirectories, names in os.walk(folder):  # links not followed
                subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
                for name in names:
                    if name.endswith(".py"):
                        path = Path(directory, name)
                        parts = path.relative_to(folder).with_suffix("").parts
                        parts = parts[:-1] if parts[-1] == "__init__" else parts
                        found[path] = ".".join((package, *parts))
        return found

    def layer(self, module: str) -> str | None:
        """The layer of an absolute module name: ``shared``, ``worker``..., TOP for the top
        package's own modules, REPOSITORY_FOLDER for a bare folder name, None when not ours."""
        parts = module.split(".")
        if parts[0] in self.bare:
            return REPOSITORY_FOLDER
        if parts[0] != PACKAGE:
            return None
        sub = ".".join(parts[:2])
        return parts[1] if len(parts) > 1 and self.subpackage(sub) else TOP

    def subpackage(self, name: str) -> bool:
        return any(package == name or package.startswith(name + ".") for package in self.packages) \
            and name != PACKAGE


def imports_of(path: Path, module: str, layout: Layout) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    relative = path.relative_to(layout.root)
    found = []
    for node in ast.walk(tree):  # every node: function-level imports too
        if isinstance(node, ast.Import):
            found += [Import(relative, node.lineno, module, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                if layout.subpackage(whole) or whole in layout.modules:
                    found.append(Import(relative, node.lineno, module, whole))
                else:
                    found.append(Import(relative, node.lineno, module, base, (alias.name,)))
        elif isinstance(node, ast.Call) and _is_import_call(node):
            found.append(Import(relative, node.lineno, module, node.args[0].value))
    return found


def _absolute(name: str | None, level: int, package: str) -> str:
    if level == 0:
        return name or ""
    base = package.split(".")[:len(package.split(".")) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    return named and bool(node.args) and isinstance(node.args[0], ast.Constant) \
        and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".")


def breaks(rule: Rule, found: Import, layout: Layout) -> bool:
    importer, target = layout.layer(found.module), layout.layer(found.target)
    if target is None or (rule.importers is not None and importer not in rule.importers):
        return False
    if rule.forbidden is not None:
        return target in rule.forbidden
    if target == TOP and found.names == ("__version__",):
        return False  # the one exception (module docstring)
    return target not in ("shared", REPOSITORY_FOLDER)  # the bare-name rule reports those


def check(root: Path, rules: list[Rule] = RULES) -> list[Violation]:
    layout = Layout(root)
    violations: dict[Violation, None] = {}  # ordered, and one line for `from x import a, b`
    for path, module in sorted(layout.files.items()):
        for found in imports_of(path, module, layout):
            violations.update((Violation(found.path, found.line, found.target, rule), None)
                              for rule in rules if breaks(rule, found, layout))
    return list(violations)


# -- the package ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_the_package_keeps_its_floors(rule):
    violations = [str(v) for v in check(ROOT, [rule])]
    print("\n".join(violations))
    assert not violations, f"{len(violations)} imports break '{rule.says}':\n" + "\n".join(violations)


def test_every_folder_of_pyproject_is_read():
    layout = Layout(ROOT)
    layers = {layout.layer(module) for module in layout.modules}
    assert {"shared", "worker", "gateway", "supervisor", TOP} <= layers
    mapped = {layout.layer(package) for package in layout.packages}
    assert mapped <= layers, f"a package-dir folder with no .py file read: {mapped - layers}"


def role_folders() -> dict[str, str]:
    """Each top-level role folder and the name it installs as (pyproject's package-dir)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in package_dir.items()
            if "/" not in folder and package != PACKAGE}


@pytest.mark.parametrize("folder", sorted(role_folders()))
def test_a_role_folder_imported_by_its_bare_name_says_what_to_import(folder):
    """From a checkout's root, ``import supervisor`` would load our folder a second time under
    another name (with its own module state). It refuses, naming the real import instead."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, f"import {folder} from the repository root worked"
    assert f"import {role_folders()[folder]} instead" in done.stderr, done.stderr[-2000:]


# -- the checker itself, on a synthetic tree -------------------------------------------------------

PYPROJECT = """
[tool.setuptools.package-dir]
modelwarden = "modelwarden"
"modelwarden.shared" = "shared"
"modelwarden.worker" = "worker"
"modelwarden.gateway" = "gateway"
"modelwarden.supervisor" = "supervisor"
"modelwarden.supervisor.routing" = "supervisor/routing"
"""
CLEAN = {
    "modelwarden/__init__.py": "from modelwarden.shared import __version__\n",
    "modelwarden/cli.py": "from modelwarden.supervisor import arbiter\nimport modelwarden.worker.main\n",
    "shared/__init__.py": "__version__ = '0'\n",
    "shared/protocol.py": "import json\nfrom modelwarden.shared import __version__\nfrom . import codec\n",
    "shared/codec.py": "from modelwarden import __version__\n",
    "worker/__init__.py": "", "worker/main.py": "from modelwarden.shared import protocol\n",
    "worker/serve.py": "", "worker/placement.py": "", "supervisor/runtime.py": "", "supervisor/pool.py": "",
    "gateway/__init__.py": "", "gateway/main.py": "import supervisor_like_pypi\nfrom ..shared import codec\n",
    "supervisor/__init__.py": "", "supervisor/arbiter.py": "from modelwarden.gateway import main\n",
    "supervisor/routing/__init__.py": "", "supervisor/routing/router.py": "from .. import arbiter\n",
    "tests/helpers.py": "from modelwarden.supervisor import arbiter\n",
    "bench/soak.py": "import tests.helpers\n",
}


def write_tree(root: Path, files: dict[str, str], pyproject: str = PYPROJECT) -> Path:
    (root / "pyproject.toml").write_text(pyproject)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def reported(root: Path) -> list[str]:
    return sorted(str(violation) for violation in check(root))


def test_a_clean_tree_has_no_violation(tmp_path):
    assert reported(write_tree(tmp_path, CLEAN)) == []


def test_a_forbidden_import_is_reported_with_its_file_line_and_rule(tmp_path):
    tree = write_tree(tmp_path, {**CLEAN, "worker/main.py": (
        "from modelwarden.shared import protocol\nfrom modelwarden.supervisor import runtime\n")})
    assert reported(tree) == [
        "worker/main.py:2 imports modelwarden.supervisor.runtime (the worker never imports the supervisor)"]


def test_a_function_level_import_is_caught(tmp_path):
    tree = write_tree(tmp_path, {**CLEAN, "gateway/main.py": (
        "def listen():\n    if True:\n        from modelwarden.worker.placement import die_with_parent\n")})
    assert reported(tree) == [
        "gateway/main.py:3 imports modelwarden.worker.placement (the gateway never imports the worker)"]


@pytest.mark.parametrize("code, target", [
    ("import importlib\nimportlib.import_module('modelwarden.supervisor.runtime')\n",
     "modelwarden.supervisor.runtime"),
    ("from importlib import import_module\nimport_module('modelwarden.supervisor')\n",
     "modelwarden.supervisor"),
    ("from ..supervisor import runtime\n", "modelwarden.supervisor.runtime"),
    ("from .. import supervisor\n", "modelwarden.supervisor"),
    ("import modelwarden.supervisor.routing.router as router\n", "modelwarden.supervisor.routing.router"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from modelwarden.supervisor import pool\n",
     "modelwarden.supervisor.pool"),
])
def test_every_spelling_of_an_import_is_caught(tmp_path, code, target):
    tree = write_tree(tmp_path, {**CLEAN, "gateway/service.py": code})
    assert [v.target for v in check(tree)] == [target]


def test_shared_may_read_only_the_version_from_the_top_package(tmp_path):
    tree = write_tree(tmp_path, {**CLEAN, "shared/codec.py": "from modelwarden import __version__, Client\n",
                                 "shared/errors.py": "from modelwarden.worker import serve\n"})
    says = "shared imports nothing of ours above it"
    assert reported(tree) == [f"shared/codec.py:1 imports modelwarden ({says})",
                              f"shared/errors.py:1 imports modelwarden.worker.serve ({says})"]


def test_repository_folders_by_bare_name_are_caught_in_every_layer(tmp_path):
    tree = write_tree(tmp_path, {
        **CLEAN, "supervisor/arbiter.py": "from tests.helpers import Daemon\n",
        "modelwarden/cli.py": "def main():\n    import bench.soak\n    import shared.codec\n"})
    says = "the package never imports tests/, bench/ or another folder by its bare name"
    assert reported(tree) == [f"modelwarden/cli.py:2 imports bench.soak ({says})",
                              f"modelwarden/cli.py:3 imports shared.codec ({says})",
                              f"supervisor/arbiter.py:1 imports tests.helpers ({says})"]


def test_a_folder_added_to_pyproject_is_covered_without_touching_the_rules(tmp_path):
    pyproject = PYPROJECT + '"modelwarden.client" = "client"\n'
    tree = write_tree(tmp_path, {**CLEAN, "client/__init__.py": "",
                                 "client/session.py": "from modelwarden.supervisor.routing import router\n"},
                      pyproject)
    assert reported(tree) == ["client/session.py:1 imports modelwarden.supervisor.routing.router "
                              "(the client never imports the supervisor)"]
