"""Our code is ours: the wheel installs one import name, ``modelwarden``, so other distributions
that own the generic names ``supervisor`` (supervisord) and ``shared`` (a PyPI project) can be
installed beside it, and removed again, without replacing or deleting any of our files.

The test builds the real wheel, installs it into a fresh virtualenv beside both of them (from
PyPI), and serves a model from that virtualenv. The fresh virtualenv borrows torch and the other
dependencies from this one through a path entry (a ``.pth`` line is a plain path: the editable
install's finder in this virtualenv is not activated by it), so nothing of the source tree is
importable there but through the wheel. There, outside the source tree, ``modelwarden --help``
and ``python -m modelwarden --help`` answer and the client names import; and the wheel holds
every package folder of the source, so a sub-package forgotten in pyproject's ``packages`` fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, poll_until, render_config

pytestmark = pytest.mark.slow


def run(command: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--disable-pip-version-check", "-q", "-w", str(out), str(ROOT)],
                timeout=900)  # it compiles the request path (setup.py): minutes on 2 loaded cores
    assert build.returncode == 0, build.stderr
    (path,) = out.glob("modelwarden-*.whl")
    return path


def fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtualenv at ``root`` holding our wheel, and the test's dependencies borrowed."""
    assert run([sys.executable, "-m", "venv", str(root)]).returncode == 0
    python = root / "bin" / "python"
    ours = run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                "--no-deps", str(wheel)])
    assert ours.returncode == 0, ours.stderr
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    borrowed = sysconfig.get_paths()["purelib"]  # torch, pyzmq, msgpack... of the test's venv
    (Path(site.stdout.strip()) / "zz_borrowed_dependencies.pth").write_text(borrowed + "\n")
    return root


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtualenv with supervisord and PyPI's ``shared`` installed beside our wheel."""
    root = fresh_venv(tmp_path_factory.mktemp("venv") / "venv", wheel)
    theirs = run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                  "--disable-pip-version-check", "supervisor==4.*", "shared"])
    if theirs.returncode != 0:
        pytest.skip(f"PyPI not reachable to fetch supervisor and shared: {theirs.stderr[-300:]}")
    return root


def python_in(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, env=env)


def test_the_wheel_holds_only_the_modelwarden_import_name(wheel):
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert tops == {"modelwarden", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for module in ("modelwarden/__init__.py", "modelwarden/examples.py", "modelwarden/supervisor/arbiter.py",
                   "modelwarden/worker/main.py", "modelwarden/client/client.py"):
        assert module in names


def test_modelwarden_supervisord_and_pypi_shared_live_side_by_side(venv, tmp_path):
    code = (
        "import modelwarden, modelwarden.supervisor.arbiter, modelwarden.worker.serve\n"
        "from modelwarden import Client, AsyncClient, RemoteError, BadInput\n"
        "import supervisor.supervisord, shared\n"
        "assert '/venv/' in modelwarden.__file__, modelwarden.__file__\n"
        "assert '/venv/' in shared.__file__ and 'modelwarden' not in shared.__file__\n"
        "print(supervisor.supervisord.__file__)\n"
    )
    result = python_in(venv, code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "/venv/" in result.stdout
    version = run([str(venv / "bin" / "modelwarden"), "--version"], cwd=tmp_path)
    assert version.returncode == 0 and "0." in version.stdout + version.stderr


def test_the_installed_command_and_python_m_answer_help_and_the_client_names_import(venv, tmp_path):
    """The two doors into the CLI and the public client names, from the wheel alone (beside
    supervisord and PyPI's ``shared``), run outside the source tree."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for command in ([str(venv / "bin" / "modelwarden"), "--help"],
                    [str(venv / "bin" / "python"), "-m", "modelwarden", "--help"]):
        answer = run(command, cwd=tmp_path, env=env)
        assert answer.returncode == 0, f"{command}: {answer.stderr}"
        assert answer.stdout.startswith("usage: modelwarden") and "serve" in answer.stdout, answer.stdout
    names = python_in(venv, (
        "import sys\n"
        "from modelwarden import Client, AsyncClient, RemoteError\n"
        "for name in (Client, AsyncClient, RemoteError):\n"
        "    where = sys.modules[name.__module__].__file__\n"
        "    assert '/venv/' in where, (name, where)\n"), tmp_path)
    assert names.returncode == 0, names.stderr


def test_the_wheel_installs_the_compiled_request_path(venv, tmp_path):
    """Outside the source tree, from the wheel alone: every module of the request path is the
    extension built with it (modelwarden/compiled.py), its source shipped beside it."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = run([str(venv / "bin" / "python"), "-m", "modelwarden.compiled"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "request path: compiled (" in result.stdout and "/venv/" not in result.stderr


def source_package_folders() -> set[str]:
    """Where each folder of the source holding .py files lands in the wheel, by pyproject's
    package-dir mapping (``supervisor/routing`` -> ``modelwarden/supervisor/routing``)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = set()
    for package, folder in mapping.items():
        for directory, subdirectories, names in os.walk(ROOT / folder):
            subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
            if any(name.endswith(".py") for name in names):
                inside = Path(directory).relative_to(ROOT / folder).parts
                folders.add("/".join((*package.split("."), *inside)))
    return folders


def test_the_wheel_holds_every_package_folder_of_the_source(wheel):
    """A sub-folder missing from pyproject's ``packages`` (a new ``supervisor/routing/``) is
    left out of the wheel by setuptools, silently: the installed daemon then fails on import."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.rpartition("/")[0] for name in archive.namelist() if name.endswith(".py")}
    expected = source_package_folders()
    assert expected - shipped == set(), "package folders missing from the wheel (pyproject's packages?)"
    assert shipped - expected == set(), "folders in the wheel that no package-dir mapping names"


def test_serving_from_the_wheel_survives_uninstalling_supervisord(venv, tmp_path):
    gone = run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "supervisor"])
    assert gone.returncode == 0, gone.stderr
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(ROOT / "examples" / "models.py", models / "tinymodels.py")
    config = tmp_path / "modelwarden.toml"
    config.write_text(render_config(
        {"runtime_dir": str(tmp_path / "run"), "python_path": [str(models)]},
        [{"name": "mlp", "source": "python:tinymodels:make_mlp", "kwargs": {"hidden": 8},
          "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 1,
          "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]}]))
    env = {key: value for key, value in os.environ.items()
           if key != "PYTHONPATH" and not key.startswith("MODELWARDEN_")}
    daemon = subprocess.Popen([str(venv / "bin" / "modelwarden"), "serve", "--config", str(config)],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client_code = (
            "import torch\n"
            "from modelwarden import Client\n"
            f"with Client('ipc://{tmp_path / 'run' / 'frontend.sock'}', timeout=5) as client:\n"
            "    print(tuple(client.infer('mlp', torch.randn(3, 64)).shape))\n"
        )

        def served() -> bool:
            result = python_in(venv, client_code, tmp_path)
            return result.returncode == 0 and "(3, 10)" in result.stdout

        poll_until(served, timeout=90, interval=0.5, message="the wheel's daemon serving mlp")
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_the_documented_install_serves_the_shipped_config(wheel, tmp_path):
    """docs/OPERATIONS.md "Install as a service", as far as it goes without systemd: a venv with
    nothing but the wheel (and its dependencies), the production config copied verbatim, the
    unit's ExecStartPre check, then the daemon serving that config's model from its own working
    directory. Only what systemd would provide is replaced: the runtime directory (the unit's
    RuntimeDirectory=) and its group (the unit's Group=), through MODELWARDEN_* overrides."""
    venv = fresh_venv(tmp_path / "opt" / ".venv", wheel)
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "modelwarden.toml"
    shutil.copy(ROOT / "systemd" / "modelwarden.toml", config)
    run_dir = tmp_path / "run"
    env = {key: value for key, value in os.environ.items()
           if key != "PYTHONPATH" and not key.startswith("MODELWARDEN_")}
    env.update(MODELWARDEN_DAEMON__RUNTIME_DIR=str(run_dir),
               MODELWARDEN_DAEMON__FRONTEND=f'["ipc://{run_dir}/frontend.sock"]',
               MODELWARDEN_DAEMON__CONTROL=f"ipc://{run_dir}/control.sock",
               MODELWARDEN_DAEMON__SHM_GROUP="root", MODELWARDEN_MODELS__mlp__WORKERS="1")
    modelwarden = str(venv / "bin" / "modelwarden")
    check = run([modelwarden, "serve", "--check", "--config", str(config)], cwd=tmp_path / "opt", env=env)
    assert check.returncode == 0 and "mlp#0" in check.stdout, check.stderr
    daemon = subprocess.Popen([modelwarden, "serve", "--config", str(config)], cwd=tmp_path / "opt",
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def ready() -> bool:
            status = run([modelwarden, "status", "--control", f"ipc://{run_dir}/control.sock"],
                         cwd=tmp_path, env=env)
            return status.returncode == 0 and "1/1 ready" in status.stdout

        poll_until(ready, timeout=120, interval=0.5, message="the shipped config's model READY")
        client_code = (
            "import torch\n"
            "from modelwarden import Client\n"
            "from modelwarden.examples import make_mlp\n"
            "x = torch.randn(3, 64)\n"
            f"with Client('ipc://{run_dir}/frontend.sock', timeout=10) as client:\n"
            "    y = client.infer('mlp', x)\n"
            "assert torch.allclose(y, make_mlp(hidden=256)(x), atol=1e-5), 'not the shipped model'\n"
            "print(tuple(y.shape))\n"
        )
        served = python_in(venv, client_code, tmp_path)
        assert served.returncode == 0 and "(3, 10)" in served.stdout, served.stderr
    finally:
        daemon.terminate()
        _, errors = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, errors.decode(errors="replace")[-3000:]
