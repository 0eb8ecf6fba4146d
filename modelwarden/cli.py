"""``modelwarden``: serve models, and talk to a running daemon.

Heavy imports (torch, the arbiter) happen inside the commands that need them: spawn imports this
module again in every worker, which must stay light and must not import torch before pinning.
"""

from __future__ import annotations

import argparse
import os
import sys

from modelwarden.shared.states import EXIT_CONFIG, EXIT_RUNTIME  # one table: shared/states.py
OUTPUT_SUFFIXES = (".npy", ".npz")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelwarden",
        description="Serve PyTorch models from isolated, pinned, probed worker processes.")
    parser.add_argument("--version", action="version", version=f"modelwarden {_version()}")
    commands = parser.add_subparsers(metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    _add_config(serve)
    serve.add_argument("--check", action="store_true",
                       help="validate the configuration and placement, print the plan, and exit")
    serve.set_defaults(func=cmd_serve)

    status = commands.add_parser(
        "status", help="show every worker; exit 0 all READY, 1 degraded, 3 unreachable")
    _add_config(status)
    _add_control(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="print the status again every SECONDS (default 2) until Ctrl-C")
    status.set_defaults(func=cmd_control, command="status")

    restart = commands.add_parser(
        "restart", help="revive FATAL workers and replace live ones (replace before retire)")
    _add_config(restart)
    _add_control(restart)
    restart.add_argument("target", nargs="?", help="a model name or a worker id (mlp#0); all if absent")
    restart.add_argument("--json", action="store_true", help="print the reply as JSON")
    restart.set_defaults(func=cmd_control, command="restart")

    stop = commands.add_parser(
        "stop", help="drain in-flight requests and stop the daemon, or only a model's or a "
                     "worker's workers (they stay STOPPED until a restart)")
    _add_config(stop)
    _add_control(stop)
    stop.add_argument("target", nargs="?", help="a model name or a worker id (mlp#0); the whole "
                                                "daemon if absent")
    stop.add_argument("--json", action="store_true", help="print the reply as JSON")
    stop.set_defaults(func=cmd_control, command="stop")

    reload = commands.add_parser(
        "reload", help="re-read the configuration file and apply what changed (as SIGHUP); "
                       "exit 2 if it is invalid (the running configuration is kept)")
    _add_config(reload)
    _add_control(reload)
    reload.add_argument("--json", action="store_true", help="print the reply as JSON")
    reload.set_defaults(func=cmd_control, command="reload")

    scale = commands.add_parser("scale", help="run N workers of a model (until the next reload)")
    _add_config(scale)
    _add_control(scale)
    scale.add_argument("model", help="model name")
    scale.add_argument("workers", type=int, metavar="N", help="number of workers")
    scale.add_argument("--json", action="store_true", help="print the reply as JSON")
    scale.set_defaults(func=cmd_control, command="scale")

    infer = commands.add_parser("infer", help="send one request: inputs from .npy/.npz files")
    _add_config(infer)
    infer.add_argument("model", help="model name")
    infer.add_argument("--input", "-i", action="append", required=True, metavar="FILE",
                       help=".npy (one tensor; repeat for several positional inputs) or .npz "
                            "(named inputs)")
    infer.add_argument("--output", "-o", metavar="FILE",
                       help="write outputs to .npy (one tensor) or .npz (several)")
    infer.add_argument("--endpoint", help="frontend endpoint (default: the first unix://, else ipc:// "
                                          "frontend of --config; else MODELWARDEN_ENDPOINT, the "
                                          "same of $MODELWARDEN_CONFIG, or the local daemon's "
                                          "local.sock, else its frontend.sock)")
    infer.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    infer.add_argument("--server-key", metavar="FILE",
                       help="tcp with CURVE: the server's public .key file, or its z85 key "
                            "(default: $MODELWARDEN_SERVER_KEY)")
    infer.add_argument("--client-key", metavar="FILE",
                       help="tcp with CURVE: this client's .key_secret file "
                            "(default: $MODELWARDEN_CLIENT_KEY)")
    infer.set_defaults(func=cmd_infer)

    keygen_help = ("write a CURVE key pair for tcp frontends: DIR/NAME.key (public) and "
                   "DIR/NAME.key_secret (secret, mode 0600)")
    keygen = commands.add_parser("keygen", help=keygen_help, description=keygen_help)
    keygen.add_argument("dir", metavar="DIR", help="where to write the keys (created 0700 if absent)")
    keygen.add_argument("--name", default="server",
                        help="file name without extension (default: server); an existing key "
                             "of that name is never overwritten")
    keygen.set_defaults(func=cmd_keygen)

    token_help = ("append a random bearer token to a gateway token_file (created mode 0600) and "
                  "print it: give it to one caller; delete its line to revoke it")
    token = commands.add_parser("token", help=token_help, description=token_help)
    token.add_argument("file", metavar="FILE", help="the [gateway] token_file")
    token.add_argument("--label", default=None,
                       help="a comment written on the line above the token (who holds it)")
    token.set_defaults(func=cmd_token)
    return parser


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", metavar="PATH",
                        help="TOML configuration (default: $MODELWARDEN_CONFIG)")


def _add_control(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--control", metavar="ENDPOINT",
                        help="control endpoint, for read-only commands (default: from the "
                             "configuration)")
    parser.add_argument("--admin", metavar="ENDPOINT",
                        help="admin endpoint, for commands that change the daemon: restart, "
                             "reload, scale, stop "
                             "(default: from the configuration; only the daemon's user and root "
                             "may reach it)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")


def _version() -> str:
    from modelwarden.shared import __version__

    return __version__


def _fail(message: str, code: int) -> int:
    print(f"modelwarden: {message}", file=sys.stderr)
    return code


def _settings(args):
    """The configuration, or a one-line error and exit code 2 (raised as SystemExit)."""
    from modelwarden.shared.config import ConfigError, load_settings

    try:
        return load_settings(args.config)
    except ConfigError as exc:
        raise SystemExit(_fail(f"config error: {exc}", EXIT_CONFIG)) from None


def cmd_serve(args) -> int:
    from modelwarden.shared.config import ENV_CONFIG, ConfigError
    from modelwarden.supervisor import auth
    from modelwarden.supervisor.fleet import placement

    if not args.config and not os.environ.get(ENV_CONFIG):
        return _fail(f"serve needs a configuration: --config PATH or ${ENV_CONFIG}", EXIT_CONFIG)
    settings = _settings(args)
    try:
        plan = placement.plan(settings)
        auth.check_keys(settings)
    except ConfigError as exc:
        return _fail(f"config error: {exc}", EXIT_CONFIG)
    if args.check:
        return _check(plan)
    return _run_daemon(settings, plan)


def _check(plan) -> int:
    """Print the plan; exit 2 if it names a CUDA device this machine lacks."""
    from modelwarden.shared.cpulist import format_cores
    from modelwarden.supervisor.fleet.devices import missing_devices

    missing = missing_devices([slot.device for slots in plan.values() for slot in slots])
    if missing:
        return _fail(f"config error: no such device here: {', '.join(missing)} (the driver lists "
                     "none in /proc/driver/nvidia/gpus or /dev/nvidia*, or CUDA_VISIBLE_DEVICES "
                     "hides it)", EXIT_CONFIG)
    for model, slots in plan.items():
        for index, slot in enumerate(slots):
            where = slot.device if slot.device != "cpu" else f"cpu[{format_cores(slot.cores)}]"
            print(f"{model}#{index}: {where}, {slot.threads} thread(s)")
    return 0


def _run_daemon(settings, plan) -> int:
    from modelwarden.shared.config import ConfigError
    from modelwarden.shared.logs import setup_logging
    from modelwarden.supervisor.arbiter import Arbiter
    from modelwarden.shared.process import DaemonError

    setup_logging("supervisor", settings.daemon.log_level, settings.daemon.log_format)
    try:
        import setproctitle

        setproctitle.setproctitle("modelwarden: supervisor")
    except ImportError:
        pass
    try:
        return Arbiter(settings, plan).run()
    except DaemonError as exc:
        return _fail(str(exc), EXIT_RUNTIME)
    except ConfigError as exc:  # a key file changed since it was checked
        return _fail(f"config error: {exc}", EXIT_CONFIG)


def cmd_control(args) -> int:
    from modelwarden.supervisor.commands import COMMANDS

    endpoint = _command_endpoint(args, COMMANDS[args.command].mutating)
    header = {"type": args.command}
    if getattr(args, "target", None):
        header["target"] = args.target
    if args.command == "scale":
        header.update(model=args.model, workers=args.workers)
    if getattr(args, "watch", None) is None:
        return _control_once(args, endpoint, header)
    return _watch(args, endpoint, header)


def _control_once(args, endpoint: str, header: dict) -> int:
    from modelwarden.client.control import control_request
    from modelwarden.shared.errors import RemoteError, Timeout
    from modelwarden.client.ipcaccess import NoDaemon, check_ipc_endpoint
    from modelwarden.shared.states import EXIT_UNREACHABLE
    from modelwarden.supervisor.commands import COMMANDS

    try:
        check_ipc_endpoint(endpoint, require_present=True)
        reply = control_request(endpoint, header, args.timeout)
    except (PermissionError, NoDaemon) as exc:
        return _fail(str(exc), EXIT_UNREACHABLE)
    except Timeout:
        return _fail(f"no daemon answers at {endpoint}", EXIT_UNREACHABLE)
    except RemoteError as exc:
        exit_code = getattr(COMMANDS[args.command], "exit_code", None)
        return _fail(str(exc), exit_code(exc) if exit_code else EXIT_RUNTIME)
    text, code = COMMANDS[args.command].render(reply, args.json)
    print(text, flush=True)
    return code


def _watch(args, endpoint: str, header: dict) -> int:
    """``status --watch``: the status every N seconds, until Ctrl-C (exit 0) or SIGTERM."""
    import time

    if args.watch <= 0:
        return _fail("--watch SECONDS must be more than 0", EXIT_CONFIG)
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            print(f"{clear}{time.strftime('%H:%M:%S')} every {args.watch:g}s (Ctrl-C ends)", flush=True)
            _control_once(args, endpoint, header)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _command_endpoint(args, mutating: bool) -> str:
    """Mutating commands go to the admin socket; the others too when the caller may reach it,
    else to the control socket; found in the
    file without validating all of it (shared/rawconfig.py: status stays light). Found with no
    configuration at all, the directory and socket must pass shared/trustdir.py's checks: a
    refusal is one line and exit 3, as for a daemon that cannot be reached."""
    from modelwarden.client.ipcaccess import NoDaemon
    from modelwarden.shared.rawconfig import ConfigError, command_endpoint
    from modelwarden.shared.states import EXIT_UNREACHABLE

    given = args.admin if mutating else args.control
    if given:
        return given
    try:
        if not mutating:
            admin = _reachable_admin(args.config)
            if admin is not None:
                return admin
        return command_endpoint(args.config, mutating)
    except ConfigError as exc:
        raise SystemExit(_fail(f"config error: {exc}", EXIT_CONFIG)) from None
    except (PermissionError, NoDaemon) as exc:  # UntrustedRuntimeDir is a PermissionError
        raise SystemExit(_fail(str(exc), EXIT_UNREACHABLE)) from None


def _reachable_admin(config) -> str | None:
    """The admin socket, when the caller may connect to it (root, the daemon's user): read-only
    commands go there too, since it is never paused -- the control socket is, while a flood
    holds the daemon's connection mark (supervisor/routing/connections.py)."""
    from modelwarden.client.ipcaccess import NoDaemon
    from modelwarden.shared.rawconfig import command_endpoint

    try:
        endpoint = command_endpoint(config, mutating=True)
    except (PermissionError, NoDaemon, OSError):
        return None
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if path is None or not os.path.exists(path) or not os.access(path, os.W_OK):
        return None
    return endpoint


def cmd_infer(args) -> int:
    from modelwarden.client.ipcaccess import NoDaemon
    from modelwarden.shared.states import EXIT_UNREACHABLE

    endpoint = args.endpoint
    if endpoint is None and args.config:
        from modelwarden.client.client import preferred_frontend

        endpoint = preferred_frontend(_settings(args).frontends)
    if args.output:
        _check_output(args.output)
    inputs = _read_inputs(args.input)

    import numpy as np

    from modelwarden.client.client import Client, RemoteError
    from modelwarden.shared.errors import ConnectionLost

    try:
        with Client(endpoint, timeout=args.timeout, copy_outputs=True,
                    server_key=args.server_key, client_key=args.client_key) as client:
            reply = client.infer(args.model, inputs, details=True)
    except (NoDaemon, PermissionError, ConnectionLost) as exc:  # ConnectionLost: unix:// only
        return _fail(str(exc), EXIT_UNREACHABLE)
    except (RemoteError, ValueError) as exc:  # ValueError: an unusable key file
        return _fail(str(exc), EXIT_RUNTIME)
    outputs = _leaves(reply.outputs)
    for name, value in outputs.items():
        array = _as_array(value)
        print(f"{name}: {value.dtype} {list(value.shape)} {np.array2string(array.ravel()[:8], precision=4)}"
              f"{' ...' if array.size > 8 else ''}")
    print(f"worker {reply.worker}  total {reply.timing.get('total_us')}us "
          f"(queue {reply.timing.get('queue_us')}us, compute {reply.timing.get('compute_us')}us)")
    if args.output:
        _write_outputs(args.output, outputs)
    return 0


def _check_output(path: str) -> None:
    """Before the request is sent: the name says the format, and its directory takes files."""
    if not path.endswith(OUTPUT_SUFFIXES):
        raise SystemExit(_fail(f"--output {path}: name a .npy file (one tensor) or an .npz file "
                               "(several)", EXIT_CONFIG))
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise SystemExit(_fail(f"--output {path}: no such directory {directory}", EXIT_CONFIG))
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise SystemExit(_fail(f"--output {path}: not writable here", EXIT_CONFIG))


def cmd_keygen(args) -> int:
    import os
    import re
    from pathlib import Path

    import zmq.auth

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.name) or args.name.startswith("."):
        return _fail(f"--name {args.name!r}: use letters, digits, '_', '.', '-'", EXIT_CONFIG)
    directory = Path(args.dir)
    public, secret = directory / f"{args.name}.key", directory / f"{args.name}.key_secret"
    existing = [str(path) for path in (public, secret) if path.exists()]
    if existing:
        return _fail(f"refusing to overwrite {', '.join(existing)}", EXIT_RUNTIME)
    old_umask = os.umask(0o077)  # the secret file is 0600 from its first byte, the directory 0700
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        zmq.auth.create_certificates(directory, args.name)
        public.chmod(0o644)  # public by design: clients and servers exchange it
    except OSError as exc:
        return _fail(f"cannot write keys in {directory}: {exc.strerror or exc}", EXIT_RUNTIME)
    finally:
        os.umask(old_umask)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600: give it to no one)")
    return 0


def cmd_token(args) -> int:
    import secrets

    from modelwarden.shared.secretfiles import SecretFileError, read_tokens

    if args.label is not None and ("\n" in args.label or "\r" in args.label):
        return _fail("--label: one line", EXIT_CONFIG)
    value = secrets.token_urlsafe(32)  # 256 bits
    lines = ([f"# {args.label}"] if args.label else []) + [value]
    try:
        fd = os.open(args.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as file:
            if file.tell() and not _ends_with_newline(args.file):
                file.write("\n")
            file.write("\n".join(lines) + "\n")
    except OSError as exc:
        return _fail(f"cannot write {args.file}: {exc.strerror or exc}", EXIT_RUNTIME)
    try:
        count = len(read_tokens(args.file))
    except SecretFileError as exc:  # written, but the gateway would refuse the file: say why
        return _fail(str(exc), EXIT_CONFIG)
    print(value)
    print(f"{args.file}: {count} token(s); a running gateway reads it again within a second",
          file=sys.stderr)
    return 0


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


def _read_inputs(paths: list[str]):
    if len(paths) == 1 and paths[0].endswith(".npz"):
        return _load(paths[0], lambda archive: {key: archive[key] for key in archive.files})
    arrays = [_load(path) for path in paths]
    return arrays[0] if len(arrays) == 1 else arrays


def _load(path: str, take=None):
    """One .npy or .npz file, or a one-line error and exit 2 (not a traceback)."""
    import zipfile

    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
        if take is None:
            return loaded
        with loaded as archive:
            return take(archive)
    except FileNotFoundError:
        raise SystemExit(_fail(f"--input {path}: no such file", EXIT_CONFIG)) from None
    except PermissionError:
        raise SystemExit(_fail(f"--input {path}: permission denied", EXIT_CONFIG)) from None
    except IsADirectoryError:
        raise SystemExit(_fail(f"--input {path}: a directory, not a .npy/.npz file", EXIT_CONFIG)) from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise SystemExit(_fail(f"--input {path}: not a readable .npy/.npz file ({exc})", EXIT_CONFIG)) from None


def _leaves(value, path: str = "") -> dict:
    """Every output tensor under a unique name, its path in the output structure ("0", "a.x")."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {path or "output": value}
    out = {}
    for key, item in items:
        out.update(_leaves(item, f"{path}.{key}" if path else str(key)))
    return out


def _as_array(value):
    """numpy for printing and saving; bfloat16 (which numpy lacks) widened to float32."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    return value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()


def _write_outputs(path: str, outputs: dict) -> None:
    import numpy as np

    arrays = {name: _as_array(value) for name, value in outputs.items()}
    if not path.endswith(".npz") and len(arrays) != 1:
        raise SystemExit(_fail(f"{len(arrays)} outputs: use an .npz file for --output", EXIT_CONFIG))
    try:
        with open(path, "wb") as handle:  # a file object: numpy adds no suffix to the name
            if path.endswith(".npz"):
                np.savez(handle, **arrays)
            else:
                np.save(handle, next(iter(arrays.values())))
    except OSError as exc:
        raise SystemExit(_fail(f"--output {path}: {exc.strerror or exc}", EXIT_RUNTIME)) from None


if __name__ == "__main__":
    sys.exit(main())
