"""The compiled request path (setup.py, modelwarden/compiled.py): after ``make install`` every
module of compiled_modules.COMPILED is the C extension built from the source beside it, and the
daemon says so at start; a tree without the build is reported as uncompiled (never a broken
import), a module edited after its build as stale; and the uncompiled path, the very same
``.py`` files, passes the unit tests of every compiled module."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from modelwarden import compiled
from modelwarden.compiled_modules import COMPILED
from modelwarden.testing import copy_checkout
from tests.helpers import ROOT, Daemon, mlp_model, poll_until

# The unit tests of the compiled modules, run again on the uncompiled path (about a minute).
UNIT_TESTS = ["tests/test_unit_mpack.py", "tests/test_unit_deadlines.py", "tests/test_unit_protocol.py", "tests/test_unit_sockets.py", "tests/test_unit_codec.py",
              "tests/test_unit_router.py", "tests/test_unit_batching.py", "tests/test_unit_requests.py",
              "tests/test_unit_limits.py", "tests/test_unit_quotas.py", "tests/test_unit_session.py",
              "tests/test_wire_text.py", "tests/test_unit_timers.py", "tests/test_unit_eventloop.py",
              "tests/test_unit_link.py", "tests/test_unit_zmtp.py", "tests/test_unit_worker_deadlines.py"]


def run_in(tree: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def uncompiled_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("uncompiled")
    copy_checkout(ROOT, tree)
    where = run_in(tree, "-c", "import modelwarden.shared.protocol as p; print(p.__file__)")
    assert where.stdout.strip() == str(tree / "modelwarden" / "shared" / "protocol.py"), where.stdout + where.stderr
    return tree


def test_every_request_path_module_is_the_extension_built_from_its_source():
    states = compiled.report()
    assert states == {name: compiled.COMPILED_STATE for name in COMPILED}, states
    for name in COMPILED:
        module = importlib.import_module(name)
        assert module.__file__.endswith(".so"), module.__file__
        assert not hasattr(module, "__cached__") or module.__cached__ is None  # no bytecode ran
    assert subprocess.run([sys.executable, "-m", "modelwarden.compiled"], capture_output=True,
                          timeout=60).returncode == 0


def test_the_daemon_logs_which_request_path_it_runs():
    with Daemon([mlp_model(workers=1)]) as daemon:
        daemon.wait_ready()
        poll_until(lambda: f"request path: compiled ({len(COMPILED)} modules, Cython)" in daemon.log(),
                   message="the start-up line naming the compiled request path")


def test_a_tree_without_the_build_is_reported_uncompiled_and_still_imports(uncompiled_tree):
    result = run_in(uncompiled_tree, "-m", "modelwarden.compiled")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{len(COMPILED)} uncompiled of {len(COMPILED)} modules" in result.stdout, result.stdout
    assert run_in(uncompiled_tree, "-m", "modelwarden.compiled", "--allow-uncompiled").returncode == 0


def test_a_module_edited_after_its_build_is_reported_stale(tmp_path):
    tree = tmp_path / "tree"
    copy_checkout(ROOT, tree)
    built = Path(importlib.import_module("modelwarden.shared.protocol").__file__)
    shutil.copy2(built, tree / "shared" / built.name)
    shutil.copy2(compiled.MANIFEST, tree / "modelwarden" / compiled.MANIFEST.name)
    source = tree / "shared" / "protocol.py"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    result = run_in(tree, "-m", "modelwarden.compiled", "--allow-uncompiled")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stale      modelwarden.shared.protocol" in result.stdout, result.stdout
    assert "not compiled: " in result.stdout and "protocol" in result.stdout


def test_the_uncompiled_path_passes_the_unit_tests_of_the_compiled_modules(uncompiled_tree):
    """One implementation of each rule: the .py files the build compiles are the code; run
    uncompiled (PYTHONPATH at a copy without the .so files), they pass the same unit tests."""
    result = run_in(uncompiled_tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UNIT_TESTS,
                    timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]


def test_declarations_edited_after_the_build_make_their_module_stale(tmp_path):
    """A .pxd is part of what its module was compiled from (shared/sockets.pxd gives C types):
    editing it alone makes the build stale, and `make compile` rebuilds on it."""
    tree = tmp_path / "tree"
    copy_checkout(ROOT, tree)
    built = Path(importlib.import_module("modelwarden.shared.sockets").__file__)
    shutil.copy2(built, tree / "shared" / built.name)
    shutil.copy2(compiled.MANIFEST, tree / "modelwarden" / compiled.MANIFEST.name)
    fresh = run_in(tree, "-m", "modelwarden.compiled", "--allow-uncompiled")
    assert "compiled   modelwarden.shared.sockets" in fresh.stdout, fresh.stdout + fresh.stderr
    declarations = tree / "shared" / "sockets.pxd"
    declarations.write_text(declarations.read_text() + "\n# edited after the build\n")
    result = run_in(tree, "-m", "modelwarden.compiled", "--allow-uncompiled")
    assert "stale      modelwarden.shared.sockets" in result.stdout, result.stdout
    assert "shared/sockets.pxd" in subprocess.run(
        [sys.executable, str(ROOT / "modelwarden" / "compiled_modules.py")], capture_output=True,
        text=True, check=True).stdout
