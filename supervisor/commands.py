"""Control commands. Each class holds both halves of one command, documented once:
the daemon side (``execute``: header in, reply out) and the CLI side (``render``: reply in,
text and exit code out). Signals become the same commands (SIGTERM is ``stop``).

Control messages use the frontend framing (see shared.protocol). Read-only commands
(``mutating = False``) are answered on the control endpoint and on the admin endpoint; commands
that change the daemon (``mutating = True``) only on the admin endpoint, which lies in the 0700
private directory (only the daemon's user and root can reach it). On the control endpoint a
mutating command gets BAD_REQUEST saying so: the request is well-formed but sent where it can
never be accepted, and no retry there helps.
  {"type": "status", "id": N}                      -> {"id", "ok", "status": {...}}       control
  {"type": "restart", "id": N, "target": "mlp"}    -> {"id", "ok", "restarted": [...]}    admin
  {"type": "reload", "id": N}                      -> {"id", "ok", "changes": [...]}      admin
  {"type": "scale", "id": N, "model": "mlp", "workers": 3} -> {"id", "ok", "changes": [...]} admin
  {"type": "stop", "id": N}                        -> {"id", "ok"}; drains and exits     admin
  {"type": "stop", "id": N, "target": "mlp#1"}     -> {"id", "ok", "stopped": [...]}      admin
A refused reload (the new file is invalid, or changes what needs a restart) is BAD_REQUEST with
the one-line reason; the CLI exits 2 for it, as for a bad file at start.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from modelwarden.shared.cpulist import format_cores
from modelwarden.shared.errors import RemoteError
from modelwarden.shared.protocol import BAD_REQUEST, ProtocolError
from modelwarden.shared.states import EXIT_DEGRADED, EXIT_FAILED, EXIT_HEALTHY, EXIT_REFUSED

MAX_WORKERS = 1024
ADMIN_ONLY = ("{command!r} changes the daemon: it is only accepted on the admin socket {admin} "
              "(the daemon's user or root)")


class CommandHost(Protocol):
    """All a command may ask of the daemon (the Arbiter): one method per thing it can do. Each
    returns what the command's reply lists, or raises ProtocolError with the reason."""

    def status(self) -> dict[str, Any]: ...  # supervisor/status.py

    def restart(self, target: str | None) -> list[str]: ...

    def reload(self) -> list[str]: ...

    def scale(self, model: str, workers: int) -> list[str]: ...

    def stop_target(self, target: str) -> list[str]: ...

    def request_stop(self, reason: str) -> None: ...


class StatusCommand:
    """Every worker's health; exit 0 when all models are fully READY, 1 when degraded."""

    name = "status"
    mutating = False

    @staticmethod
    def execute(host: CommandHost, header: dict) -> dict:
        return {"status": host.status()}

    @staticmethod
    def render(reply: dict, as_json: bool) -> tuple[str, int]:
        status = reply["status"]
        healthy = all(model["ready"] == model["workers"] for model in status["models"])
        code = EXIT_HEALTHY if healthy else EXIT_DEGRADED
        return (json.dumps(status, indent=2) if as_json else status_table(status)), code


class RestartCommand:
    """Revive FATAL slots and replace live workers (replace before retire) of a model or worker."""

    name = "restart"
    mutating = True

    @staticmethod
    def execute(host: CommandHost, header: dict) -> dict:
        target = header.get("target")
        if target is not None and not isinstance(target, str):
            raise ProtocolError(BAD_REQUEST, "'target' must be a model name or a worker id")
        return {"restarted": host.restart(target)}

    @staticmethod
    def render(reply: dict, as_json: bool) -> tuple[str, int]:
        names = reply["restarted"]
        text = json.dumps(reply) if as_json else (
            "restarting: " + ", ".join(names) if names else "nothing to restart")
        return text, 0


class ReloadCommand:
    """Re-read the configuration file and apply what changed (supervisor/fleet/reload.py), as SIGHUP
    does; an invalid file changes nothing and its error comes back (exit 2)."""

    name = "reload"
    mutating = True

    @staticmethod
    def execute(host: CommandHost, header: dict) -> dict:
        return {"changes": host.reload()}

    @staticmethod
    def render(reply: dict, as_json: bool) -> tuple[str, int]:
        return (json.dumps(reply) if as_json else "\n".join(
            f"reloaded: {line}" for line in reply["changes"])), 0

    @staticmethod
    def exit_code(error: RemoteError) -> int:
        return EXIT_REFUSED if error.code == BAD_REQUEST else EXIT_FAILED


class ScaleCommand:
    """Run N workers of one model until the next reload re-reads the file."""

    name = "scale"
    mutating = True

    @staticmethod
    def execute(host: CommandHost, header: dict) -> dict:
        model, workers = header.get("model"), header.get("workers")
        if not isinstance(model, str):
            raise ProtocolError(BAD_REQUEST, "'model' must be a model name")
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
            raise ProtocolError(BAD_REQUEST, f"'workers' must be an integer from 1 to {MAX_WORKERS}")
        return {"changes": host.scale(model, workers)}

    render = ReloadCommand.render
    exit_code = ReloadCommand.exit_code


class StopCommand:
    """Without a target: drain and exit, as SIGTERM does. With one (a model, or a worker id):
    drain and stop those workers, which stay STOPPED until a restart or reload."""

    name = "stop"
    mutating = True

    @staticmethod
    def execute(host: CommandHost, header: dict) -> dict:
        target = header.get("target")
        if target is not None:
            if not isinstance(target, str):
                raise ProtocolError(BAD_REQUEST, "'target' must be a model name or a worker id")
            return {"stopped": host.stop_target(target)}
        host.request_stop("stop command")
        return {}

    @staticmethod
    def render(reply: dict, as_json: bool) -> tuple[str, int]:
        if as_json:
            return json.dumps(reply), 0
        if "stopped" not in reply:
            return "stopping", 0
        names = reply["stopped"]
        return ("stopping: " + ", ".join(names)) if names else "nothing to stop", 0


COMMANDS = {command.name: command for command in (StatusCommand, RestartCommand, ReloadCommand,
                                                  ScaleCommand, StopCommand)}


def status_table(status: dict) -> str:
    daemon = status["daemon"]
    lines = [f"modelwarden {daemon['version']}  pid {daemon['pid']}  up {_duration(daemon['uptime_s'])}"
             f"  frontend {' '.join(daemon['endpoints']['frontend'])}"]
    for model in status["models"]:
        fatal = f"  FATAL: {', '.join(model['fatal_slots'])}" if model["fatal_slots"] else ""
        rolling = ", rolling" if model.get("rolling") else ""
        lines.append(f"model {model['name']} (version {model.get('version')}): {model['ready']}/"
                     f"{model['workers']} ready, {model['queued']} queued{rolling}"
                     f"{_batching_text(model.get('batching'))}{fatal}")
    header = ("ID", "MODEL", "STATE", "PID", "PLACEMENT", "THR", "UPTIME", "REQS", "ERRS",
              "RESTARTS", "P50", "RSS", "PROBE")
    rows = [header] + [_table_row(worker) for worker in status["workers"]]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
                 for row in rows)
    if status.get("gateway"):
        lines.append(_gateway_text(status["gateway"]))
    lines.extend(_identity_line(row) for row in daemon.get("identities", [])[:IDENTITY_LINES])
    for worker in status["workers"]:
        if worker.get("error") or (worker["state"] != "READY" and worker.get("last_exit")):
            error = f"; {worker['error']}" if worker.get("error") else ""
            retry = (f"; next try in {_duration(worker['retry_in_s'])}"
                     if worker.get("retry_in_s") is not None else "")
            lines.append(f"{worker['id']}: last exit {worker.get('last_exit')}{error}{retry}")
    return "\n".join(lines)


IDENTITY_LINES = 8  # the largest holders; --json lists up to quotas.SHOWN_IDENTITIES


def _identity_line(row: dict) -> str:
    """What one identity holds (supervisor/routing/quotas.py): its connections, buffers, requests."""
    return (f"identity {row['identity']}: {row['connections']} connections, {row['buffers']} "
            f"buffers ({_bytes(row['buffer_bytes'])}), {row['requests']} requests "
            f"({_bytes(row['request_bytes'])}) in flight")


def _gateway_text(gateway: dict) -> str:
    listeners = ", ".join(f"{kind} {gateway[kind]}" for kind in ("http", "grpc") if gateway.get(kind))
    exit_text = f", last exit {gateway['last_exit']}" if gateway.get("last_exit") else ""
    callers = "".join(f"\n  caller {row['identity']}: {row['requests']} calls "
                      f"({_bytes(row['request_bytes'])}) in flight"
                      for row in gateway.get("identities", [])[:IDENTITY_LINES])
    return (f"gateway {gateway['state']}  pid {gateway['pid'] or '-'}  {listeners}  access "
            f"{', '.join(gateway['access'])}  up {_duration(gateway['uptime_s'])}  restarts "
            f"{gateway['restarts']}{exit_text}{callers}")


def _batching_text(batching: dict | None) -> str:
    if not batching:
        return ""
    return (f", batches {batching['batches']} (mean size {batching['mean_size']}, "
            f"max {batching['max_size']} of {batching['max_size_allowed']})")


def _table_row(worker: dict) -> tuple:
    placement = worker["device"] if str(worker["device"]).startswith("cuda") else (
        f"cpu[{format_cores(worker['cores'])}]")
    probe = worker.get("probe") or {}
    probe_text = "-" if probe.get("ok") is None else ("ok" if probe["ok"] else
                                                     f"FAIL x{probe['consecutive_failures']}")
    return (worker["id"], worker["model"], worker["state"], worker["pid"] or "-", placement,
            worker["threads"], _duration(worker["uptime_s"]), worker["requests"], worker["errors"],
            worker["restarts"], _micros(worker["latency_p50_us"]), _bytes(worker["rss_bytes"]),
            probe_text)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


def _micros(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.1f}ms" if value >= 1000 else f"{value}us"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return str(value)

