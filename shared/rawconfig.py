"""The configuration before validation: the TOML file merged with ``MODELWARDEN_*`` variables.

This module is the light half of ``modelwarden.shared.config``: the standard library only, no
pydantic. ``modelwarden status`` and the other control commands run it to find the daemon's
sockets, so an operator's ``watch modelwarden status`` does not pay for building the validated
model of the whole file; ``serve`` and ``--check`` validate everything (config.load_settings).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from modelwarden.shared.trustdir import check_runtime_dir, check_socket_in

ENV_PREFIX = "MODELWARDEN_"
ENV_CONFIG = "MODELWARDEN_CONFIG"
ENV_ENDPOINT = "MODELWARDEN_ENDPOINT"
ENV_SERVER_KEY = "MODELWARDEN_SERVER_KEY"
ENV_CLIENT_KEY = "MODELWARDEN_CLIENT_KEY"
_NOT_OVERRIDES = {ENV_CONFIG, ENV_ENDPOINT, ENV_SERVER_KEY, ENV_CLIENT_KEY}
SYSTEM_RUNTIME_DIR = Path("/run/modelwarden")  # the system daemon's (root's default)
PID_FILE = "modelwarden.pid"  # supervisor/runtime.py: the daemon's lock
FRONTEND_SOCKET = "frontend.sock"  # the default ZeroMQ frontend (ipc://)
LOCAL_SOCKET = "local.sock"  # the default local frontend (unix://, supervisor/routing/localfront.py)


class ConfigError(Exception):
    """An unusable configuration: ``key`` is a dotted path into the file, ``problem`` says why."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


def config_path(path: str | Path | None) -> Path | None:
    """The file to read: ``path``, else ``MODELWARDEN_CONFIG``, else none (defaults only)."""
    if path is None and os.environ.get(ENV_CONFIG):
        path = os.environ[ENV_CONFIG]
    return Path(path).expanduser().resolve() if path is not None else None


def raw_settings(path: Path | None) -> dict[str, Any]:
    """The file's tables with every ``MODELWARDEN_*`` override applied, not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path)
        data["config_path"] = str(path)
    for name, raw in sorted(os.environ.items()):
        if name.startswith(ENV_PREFIX) and name not in _NOT_OVERRIDES:
            keys = name[len(ENV_PREFIX):].split("__")
            _apply_override(data, [key.lower() for key in keys[:1]] + keys[1:], raw)
    return data


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path} is not valid TOML: {exc}") from None


def _env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _apply_override(data: dict[str, Any], keys: list[str], raw: str) -> None:
    if keys[0] == "models" and len(keys) >= 3:
        models = data.setdefault("models", [])
        target = _find_model(models, keys[1])
        node = target
        keys = keys[2:]
    else:
        node = data
    keys = [key.lower() for key in keys]
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(".".join(keys), "environment override reaches into a non-table")
    node[keys[-1]] = _env_value(raw)


def _find_model(models: list, key: str) -> dict:
    for model in models:
        if isinstance(model, dict) and model.get("name") == key:
            return model
    if key.isdigit() and int(key) < len(models):
        return models[int(key)]
    raise ConfigError(f"models.{key}", "environment override names no configured model")


def default_runtime_dir() -> Path:
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "modelwarden" if xdg else Path(f"/tmp/modelwarden-{os.geteuid()}")


def client_runtime_dir() -> Path:
    """Where a client with no configuration looks for the daemon: its own default runtime
    directory if a daemon has run there (its pid file), else the system daemon's when there is
    one, so a member of ``shm_group`` reaches it without MODELWARDEN_CONFIG. Nobody configured
    that directory, so it is checked before it is used (shared/trustdir.py): UntrustedRuntimeDir
    when another user made it, NoDaemon when it does not exist; never a fallback."""
    own = default_runtime_dir()
    # The system directory itself, not its pid file: someone outside the group cannot see into
    # it, and should be told "permission denied" there rather than "no socket" in their own.
    if os.path.lexists(own / PID_FILE) or not SYSTEM_RUNTIME_DIR.is_dir():
        chosen = own
    else:
        chosen = SYSTEM_RUNTIME_DIR
    check_runtime_dir(chosen)
    return chosen


def default_frontends(runtime: Path) -> list[str]:
    """A daemon's frontends when ``[daemon] frontend`` is not set: ZeroMQ over ``ipc://`` (what
    ``modelwarden.connect``, the gateway and clients in other languages speak) and the local
    frontend over ``unix://`` (what a client on this host picks: no libzmq thread on either
    side of it)."""
    return [f"ipc://{runtime}/{FRONTEND_SOCKET}", f"unix://{runtime}/{LOCAL_SOCKET}"]


def discovered_frontend(runtime: Path) -> str:
    """The frontend a client with no configuration uses in a directory found by
    ``client_runtime_dir``: the local one where the daemon made it, else the ipc one. Either
    passes ``check_socket_in`` first."""
    local = runtime / LOCAL_SOCKET
    if os.path.lexists(local):
        check_socket_in(runtime, local)
        return f"unix://{local}"
    return discovered_socket(runtime, FRONTEND_SOCKET)


def discovered_socket(runtime: Path, name: str) -> str:
    """``ipc://RUNTIME/NAME`` for a directory found by ``client_runtime_dir``, once the socket
    (and ``private/`` for the admin socket) pass the same check."""
    path = runtime / name
    check_socket_in(runtime, path)
    return f"ipc://{path}"


def check_announced_channel(channel: str) -> None:
    """The ``buffers.sock`` a daemon's hello names, checked before a descriptor goes there
    when it lies in a directory a client looks in unconfigured (another user may have made
    it); elsewhere the daemon's configuration put it, and the client trusts that daemon."""
    path = Path(channel)
    for runtime in {default_runtime_dir(), SYSTEM_RUNTIME_DIR}:
        if path.parent == runtime or path.parent.parent == runtime:
            check_socket_in(runtime, path)


def runtime_dir(configured: str | Path | None, base_dir: Path) -> Path:
    """``[daemon] runtime_dir`` (relative to the config file's directory), else the default."""
    if configured is None:
        return default_runtime_dir()
    path = Path(configured).expanduser()
    return path if path.is_absolute() else base_dir / path


def frontend_endpoints(path: str | Path | None = None) -> list[str]:
    """The frontends a client may use, read as ``command_endpoint`` reads its socket: without
    validating the whole file (that is the daemon's business, ``shared/config.py``), so a client
    loads the standard library only. ``[daemon] frontend``, else the runtime directory's default
    frontends (``default_frontends``); [] when the file or its ``[daemon]`` table cannot be used."""
    resolved = config_path(path)
    try:
        daemon = raw_settings(resolved).get("daemon", {})
    except ConfigError:
        return []
    if not isinstance(daemon, dict):
        return []
    frontend = daemon.get("frontend")
    if frontend is not None:
        usable = isinstance(frontend, list) and all(isinstance(item, str) for item in frontend)
        return list(frontend) if usable else []
    configured = daemon.get("runtime_dir")
    if configured is not None and not isinstance(configured, str):
        return []
    runtime = runtime_dir(configured, resolved.parent if resolved else Path.cwd())
    return default_frontends(runtime)


def control_endpoint(runtime: Path, configured: str | None) -> str:
    return configured or f"ipc://{runtime}/control.sock"


def admin_endpoint(runtime: Path, configured: str | None) -> str:
    return configured or f"ipc://{runtime / 'private'}/admin.sock"


def command_endpoint(path: str | Path | None, mutating: bool) -> str:
    """The socket a control command talks to, read without validating the whole file: a daemon
    whose file has since been broken by an edit still answers ``status``. With no file and no
    ``runtime_dir``, the daemon is looked for where ``client_runtime_dir`` says, and the
    directory and socket are checked first (UntrustedRuntimeDir, NoDaemon)."""
    resolved = config_path(path)
    daemon = raw_settings(resolved).get("daemon", {})
    if not isinstance(daemon, dict):
        raise ConfigError("daemon", "must be a table")
    for key in ("runtime_dir", "control", "admin"):
        if daemon.get(key) is not None and not isinstance(daemon[key], str):
            raise ConfigError(f"daemon.{key}", "must be a string")
    if resolved is None and daemon.get("runtime_dir") is None and not daemon.get(
            "admin" if mutating else "control"):
        runtime = client_runtime_dir()
        return discovered_socket(runtime, "private/admin.sock" if mutating else "control.sock")
    runtime = runtime_dir(daemon.get("runtime_dir"), resolved.parent if resolved else Path.cwd())
    if mutating:
        return admin_endpoint(runtime, daemon.get("admin"))
    return control_endpoint(runtime, daemon.get("control"))
