"""A real daemon for tools and integration tests: start it from a configuration in a private
directory, wait for its workers, ask its status, stop it.

    from modelwarden import Client
    from modelwarden.testing import LocalDaemon

    config = {"daemon": {"python_path": ["/srv/models"]},
              "models": [{"name": "mlp", "source": "python:mymodels:make_mlp", "workers": 1,
                          "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]}]}
    with LocalDaemon(config) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            client.infer("mlp", torch.randn(3, 64))

The daemon is the one operators run (``python -m modelwarden serve --config FILE``), in a
subprocess: nothing is mocked, so what a test sees is what production does. Its runtime directory
(sockets, pid file) is ``DIR/run`` under a fresh ``/tmp/mw-*`` directory, short because a unix
socket path has at most 107 bytes; its output goes to ``DIR/daemon.log``; all of it is removed by
``cleanup()`` (the context manager's exit).

Every wait is a poll with a deadline (``poll_until``), never a guessed sleep; a daemon that exits
while it is waited for fails the wait at once (``DaemonGone``) with the end of its log. Failures
raise AssertionError (subclasses), which pytest reports as test failures.

This module is for tools (bench/) and for users' own tests: it imports the standard library and
``modelwarden.shared`` when imported, never torch; the control request, and the supervisor's
command table for ``command()``, are imported when first used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from modelwarden.shared.rawconfig import (admin_endpoint, control_endpoint, default_frontends,
                                          runtime_dir)

ENV_RUNTIME_DIR = "MODELWARDEN_DAEMON__RUNTIME_DIR"  # rawconfig's override of [daemon] runtime_dir


class DaemonGone(AssertionError):
    """The daemon exited: no poll for anything else can succeed any more."""


class PollTimeout(AssertionError):
    """``poll_until``'s condition stayed false until the deadline."""


def poll_until(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
               message: str = "condition") -> Any:
    """Call ``condition`` until it returns something truthy and return that; PollTimeout after
    ``timeout`` seconds. An exception from the condition counts as "not yet" (it may race with a
    restarting daemon) and is named in the timeout's message, but DaemonGone fails at once: a
    crashed daemon must not cost the whole timeout. The pause between tries is ``interval``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except DaemonGone:
            raise
        except Exception as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise PollTimeout(f"timed out after {timeout}s waiting for {message}"
                              + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval)  # between tries of a deadline poll, never to wait out an event


# -- configuration files ------------------------------------------------------------------------


class ManualClock:
    """A clock a test moves by hand (``clock.now = ...``): what timer logic takes instead of
    ``time.monotonic`` in unit tests."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def toml_value(value: Any) -> str:
    """One TOML value: booleans, numbers, strings, arrays and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    raise TypeError(f"no TOML value for {type(value).__name__}")


def render_toml(document: Mapping[str, Any]) -> str:
    """A TOML document from plain data: a mapping becomes a ``[table]``, a non-empty list of
    mappings an array of ``[[tables]]`` whose own mappings become ``[name.key]`` sub-tables (as
    ``[models.probe]``), anything else ``key = value``. Loose keys come first: after a table
    header they would belong to that table."""
    loose, tables = [], []
    for key, value in document.items():
        if isinstance(value, Mapping):
            tables += ["", f"[{key}]"] + _pairs(value)
        elif _is_table_array(value):
            for item in value:
                tables += ["", f"[[{key}]]"] + _pairs(item, keep=lambda v: not isinstance(v, Mapping))
                for sub, table in item.items():
                    if isinstance(table, Mapping):
                        tables += [f"[{key}.{sub}]"] + _pairs(table)
        else:
            loose.append(f"{key} = {toml_value(value)}")
    return "\n".join(loose + tables).lstrip("\n") + "\n"


def _pairs(table: Mapping[str, Any], keep: Callable[[Any], bool] = lambda value: True) -> list[str]:
    return [f"{key} = {toml_value(value)}" for key, value in table.items() if keep(value)]


def _is_table_array(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, Mapping) for v in value)


def render_config(daemon: Mapping[str, Any], models: list[Mapping[str, Any]]) -> str:
    """A modelwarden configuration file: the ``[daemon]`` table and one ``[[models]]`` each."""
    return render_toml({"daemon": daemon, "models": models})


# -- the daemon ---------------------------------------------------------------------------------


class LocalDaemon:
    """The real daemon in a subprocess, on a private runtime directory.

    ``config`` is either a mapping of the file's tables (``{"daemon": {...}, "models": [...]}``),
    written to ``DIR/modelwarden.toml`` with ``runtime_dir = DIR/run`` unless it names one, or
    the path of an existing file, used as it is with its runtime directory moved to ``DIR/run``
    by the ``MODELWARDEN_DAEMON__RUNTIME_DIR`` override (sockets it names explicitly stay
    where it names them). ``env`` adds to (or, with None values, removes from) this process's
    environment; ``MODELWARDEN_CONFIG`` is never passed on. ``directory``: an empty directory to
    use as DIR instead of a fresh one (it is removed by ``cleanup()`` all the same).
    """

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike, *,
                 env: Mapping[str, str | None] | None = None, cwd: str | os.PathLike | None = None,
                 directory: str | os.PathLike | None = None, python: str = sys.executable,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        fresh = directory is None  # short: a unix socket path has at most 107 bytes
        self.dir = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp") if fresh else directory)
        self.log_path = self.dir / "daemon.log"
        self.env = _environment(env)
        daemon = self._write_or_take(config)
        self.runtime_dir = runtime_dir(daemon["runtime_dir"], self.config_path.parent)
        # The first frontend: ZeroMQ's, by default (the daemon also serves a local one then).
        self.endpoint = (daemon.get("frontend") or default_frontends(self.runtime_dir))[0]
        self.control = control_endpoint(self.runtime_dir, daemon.get("control"))
        self.admin = admin_endpoint(self.runtime_dir, daemon.get("admin"))
        self.cwd = Path(cwd) if cwd is not None else self.dir
        self.python = python
        self.preexec_fn = preexec_fn
        self.process: subprocess.Popen | None = None
        self._log = None

    def _write_or_take(self, config: Mapping[str, Any] | str | os.PathLike) -> dict:
        """Sets ``config_path``; returns the ``[daemon]`` table as the daemon will see it."""
        if isinstance(config, Mapping):
            daemon = {"runtime_dir": str(self.dir / "run"), **config.get("daemon", {})}
            self.config_path = self.dir / "modelwarden.toml"
            self.config_path.write_text(render_toml({**config, "daemon": daemon}))
            return daemon
        self.config_path = Path(config).resolve()
        daemon = tomllib.loads(self.config_path.read_text()).get("daemon", {})
        self.env[ENV_RUNTIME_DIR] = str(self.dir / "run")
        return {**daemon, "runtime_dir": self.env[ENV_RUNTIME_DIR]}

    def start(self) -> "LocalDaemon":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [self.python, "-m", "modelwarden", "serve", "--config", str(self.config_path)],
            cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=self.preexec_fn)
        return self

    def check_running(self) -> None:
        """DaemonGone, with the end of its log, if the daemon has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise DaemonGone(f"daemon exited with {self.process.returncode}:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self, timeout: float = 5.0, endpoint: str | None = None) -> dict:
        """The daemon's status, asked on the admin socket as the operator's ``modelwarden
        status`` asks (it is never paused: the control socket is, under a flood); ``endpoint``
        to ask elsewhere."""
        from modelwarden.client.control import control_request

        self.check_running()
        return control_request(endpoint or self.admin, {"type": "status"}, timeout)["status"]

    def command(self, command: str, **fields: Any) -> dict:
        """A control command on the socket the CLI would use: the admin socket for the
        mutating ones (``restart``, ``reload``...), the control socket for the others."""
        from modelwarden.client.control import control_request
        from modelwarden.supervisor.commands import COMMANDS

        endpoint = self.admin if COMMANDS[command].mutating else self.control
        return control_request(endpoint, {"type": command, **fields}, 5.0)

    def workers(self, model: str | None = None, state: str | None = None) -> list[dict]:
        """The status's workers, of ``model`` and in ``state`` if given."""
        return [worker for worker in self.status()["workers"]
                if (model is None or worker["model"] == model)
                and (state is None or worker["state"] == state)]

    def worker_pids(self) -> list[int]:
        return [worker["pid"] for worker in self.status()["workers"] if worker["pid"]]

    def wait_ready(self, timeout: float = 90.0, models: list[str] | None = None) -> dict:
        """The status once every worker of ``models`` (default: all) is READY."""
        def all_ready() -> dict | None:
            status = self.status(timeout=2.0)
            wanted = [m for m in status["models"] if models is None or m["name"] in models]
            return status if all(m["ready"] == m["workers"] for m in wanted) else None

        return poll_until(all_ready, timeout, message="every worker READY")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, as systemd stops it, and its exit status; AssertionError (after a SIGKILL)
        if it has not exited within ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
            raise AssertionError(f"daemon did not stop within {timeout}s:\n{self.log()}") from None

    def cleanup(self) -> None:
        """Stop the daemon, SIGKILL any worker it left behind, remove the directory."""
        pids = []
        try:
            if self.process is not None and self.process.poll() is None:
                pids = self.worker_pids()
        except Exception:  # a daemon too broken to answer is still stopped below
            pass
        try:
            self.stop()
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self._log is not None:
                self._log.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalDaemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def _environment(changes: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``changes`` (None removes), less MODELWARDEN_CONFIG:
    the daemon reads the file it is given, never one the caller's shell points to."""
    env = dict(os.environ)
    for key, value in (changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.pop("MODELWARDEN_CONFIG", None)
    return env


# -- leaks -------------------------------------------------------------------------------------


def memfd_holders(exclude: tuple[int, ...] = ()) -> dict[int, int]:
    """pid -> how many modelwarden buffer descriptors (``memfd:modelwarden`` in /proc/PID/fd) it
    holds, for every process on the machine but ``exclude``: after a test, or a soak, none but
    the daemons still running should hold one (a leak keeps shared memory alive)."""
    from modelwarden.shared.shm import MEMFD_NAME  # numpy: when first asked, not at import

    link = f"/memfd:{MEMFD_NAME} (deleted)"
    holders: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or not ours to read
            continue
        count = sum(1 for fd in fds if _readlink(f"/proc/{entry}/fd/{fd}") == link)
        if count:
            holders[int(entry)] = count
    return holders


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # closed while we looked
        return None


# -- Triton's tools -----------------------------------------------------------------------------


def copy_checkout(root: Path, destination: Path) -> None:
    """A copy of the source checkout at ``root`` (what git tracks, and untracked files git does
    not ignore) importable as ``modelwarden`` with ``PYTHONPATH=destination``: its
    ``modelwarden/`` folder gains links to the role folders (pyproject's package-dir). Ignored
    files stay out, the compiled modules (``*.so``) with them: the copy runs the uncompiled
    request path, the very ``.py`` files the build compiles (modelwarden/compiled.py)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = root / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for role in sorted({folder.split("/")[0] for package, folder in package_dir.items()
                        if package.count(".") == 1}):
        (destination / "modelwarden" / role).symlink_to(destination / role, target_is_directory=True)


def perf_analyzer() -> tuple[Path, dict] | str:
    """Triton's perf_analyzer (a C++ client in tritonclient's wheel, the gateway-test extra)
    beside this interpreter, and the environment it runs in; or why it cannot run here."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.exists():
        return "perf_analyzer is not installed (tritonclient's wheel ships it)"
    env = dict(os.environ)
    try:  # it links libcudart even to measure a CPU server: the gateway-test extra has it
        import nvidia.cuda_runtime

        lib = Path(list(nvidia.cuda_runtime.__path__)[0], "lib")
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    except ImportError:
        pass
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=env,
                          timeout=30)
    if done.returncode != 0:
        return (f"perf_analyzer cannot run here: {done.stderr.strip()[-160:]} "
                "(Debian: apt install libb64-0d)")
    return binary, env
