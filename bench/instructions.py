"""Instructions per request, counted by callgrind: the measure this noisy 2-core machine cannot
spoil (CPU time moves with whatever else runs; instruction counts do not).

    python bench/instructions.py [--requests N] [--client-requests N] [--top K]
                                 [--skip-uncompiled] [--against CHECKOUT] [--json PATH]

Each row runs one process under ``valgrind --tool=callgrind`` with instrumentation off until the
load starts, then counts every instruction of every thread of that process (libzmq's I/O thread
included; not the kernel's work in system calls) over N requests, and divides:

* ``floor``: a C ``zmq.proxy`` broker (ROUTER -> DEALER, the two hops our supervisor makes), REQ
  clients and REP echoes outside valgrind, 1 KiB, 8 in flight: what routing costs with nothing
  of ours in it;
* ``supervisor``: our daemon serving W1 (MLP 64 -> 256 -> 10, [1, 64]) at 64 in flight to two
  workers, batching off and on (max 16, no delay), its client connected before the count;
* ``client``: one client process's sequential 1 KiB round trips to an identity model, the
  daemon running natively;
* ``worker``: the same round trips, counted in the model's one worker (spawned under callgrind
  by a daemon and a client running natively).

The supervisor, client and worker rows are measured for this checkout compiled, for an uncompiled copy
of it (the same sources, run as Python), and with ``--against`` for another checkout compiled in
place (``git worktree add /tmp/base COMMIT``, then ``python setup.py build_ext --inplace`` there;
its role folders are linked under its ``modelwarden/`` here): the commit before a change, side by
side.

The supervisor and client rows are also measured for this checkout's client on the daemon's local
frontend (``unix://``, rows ending ", unix": no libzmq in either process), against the others'
rows over ``ipc://``; the worker's side is the same whichever frontend the client uses.

Prints each row, the targets of issue 24 that instruction counts can state (as ratios within
this run: MET or MISS), and the K compiled functions with the most instructions (inclusive) in
the compiled batching-off run: where the time goes. ``--json`` writes the rows and targets
(docs/results/instructions.json, which bench/report.py draws). Needs valgrind (``apt-get install
valgrind``); takes about 10 minutes, more with ``--against``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IN_FLIGHT, FLOOR_IN_FLIGHT = 64, 8
WARMUP = 200
UNIX = ", unix"  # a row key's ending: this checkout's client on the local frontend (unix://)


def valgrind(out: Path) -> tuple[str, ...]:
    """The command prefix that runs a process under callgrind, counting nothing until told."""
    return ("valgrind", "-q", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}")


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def counted(pid: int, out: Path, load) -> int:
    """Run ``load()`` with instrumentation on; the instructions it cost the process."""
    control(pid, "-i", "on")
    load()
    control(pid, "-d")
    control(pid, "-i", "off")
    return latest_count(out)


def latest_count(out: Path) -> int:
    """The instructions in the newest dump callgrind wrote for ``out``."""
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda path: path.stat().st_mtime)
    return total_instructions(dumps[-1])


def total_instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


# -- the floor: C zmq.proxy -------------------------------------------------------------------

PROXY = """
import sys, zmq
context = zmq.Context()
front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
front.bind(sys.argv[1]); back.bind(sys.argv[2])
zmq.proxy(front, back)
"""


def _echo(endpoint: str, stop: threading.Event) -> None:
    context = zmq.Context.instance()
    rep = context.socket(zmq.REP)
    rep.connect(endpoint)
    poller = zmq.Poller()
    poller.register(rep, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            rep.send(rep.recv(copy=False), copy=False)
    rep.close(0)


def floor(workdir: Path, requests: int) -> int:
    front, back = f"ipc://{workdir}/front.sock", f"ipc://{workdir}/back.sock"
    out = workdir / "proxy.out"
    proxy = subprocess.Popen([*valgrind(out), sys.executable, "-c", PROXY, front, back])
    stop = threading.Event()
    echoes = [threading.Thread(target=_echo, args=(back, stop), daemon=True) for _ in range(2)]
    for echo in echoes:
        echo.start()
    context = zmq.Context.instance()
    data = np.random.default_rng(0).bytes(1024)
    sockets = []
    try:
        for _ in range(FLOOR_IN_FLIGHT):
            sock = context.socket(zmq.REQ)
            sock.connect(front)
            sock.send(data)
            if not sock.poll(120_000):
                raise RuntimeError("the proxy under valgrind did not answer")
            sock.recv()
            sockets.append(sock)

        def load() -> None:
            each = requests // FLOOR_IN_FLIGHT

            def client(sock):
                for _ in range(each):
                    sock.send(data, copy=False)
                    sock.recv(copy=False)

            threads = [threading.Thread(target=client, args=(sock,)) for sock in sockets]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        return counted(proxy.pid, out, load) // (requests // FLOOR_IN_FLIGHT * FLOOR_IN_FLIGHT)
    finally:
        stop.set()
        for sock in sockets:
            sock.close(0)
        proxy.kill()
        proxy.wait()


# -- our supervisor ---------------------------------------------------------------------------

def supervisor(workdir: Path, tree: Path, batching: dict | None, requests: int,
               local: bool = False) -> int:
    """``local``: the client on the daemon's ``unix://`` frontend, not its ``ipc://`` one."""
    from bench import serving
    from modelwarden import AsyncClient

    workloads = serving.make_workloads(["W1"])
    runtime = workdir / ("on" if batching else "off") / (tree.name + ("-unix" if local else ""))
    runtime.mkdir(parents=True)
    text = serving.mw_config_text(runtime / "run", workloads, batching).replace(
        f'python_path = ["{ROOT}"]', f'python_path = ["{tree}"]')
    if local:
        text, unix = serving.with_local_frontend(text, runtime / "run")
    out = runtime / "supervisor.out"
    # Under valgrind the supervisor starts in about a minute; its workers run natively.
    daemon, endpoint = serving.start_daemon(runtime, "supervisor", text, {"w1": workloads["W1"]},
                                            wrapper=valgrind(out), tree=tree, ready_s=600)
    if local:
        endpoint = unix
    x = workloads["W1"].inputs[0]

    async def load(client, count: int) -> None:
        left = count

        async def one():
            nonlocal left
            while left > 0:
                left -= 1
                await client.infer("w1", x)

        await asyncio.gather(*[one() for _ in range(IN_FLIGHT)])

    async def run() -> int:
        # One client for the warm-up and the count: its connection and hello are not counted.
        async with AsyncClient(endpoint, timeout=300) as client:
            await load(client, WARMUP)
            control(daemon.pid, "-i", "on")
            await load(client, requests)
            control(daemon.pid, "-d")
            control(daemon.pid, "-i", "off")
        return latest_count(out)

    try:
        return asyncio.run(run()) // requests
    finally:
        serving.stop_process(daemon)


# -- a client's side of a 1 KiB round trip ------------------------------------------------------

CLIENT = """
import os, subprocess, sys
import torch
from modelwarden.client.client import Client
endpoint, warmup, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def control(*args):
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)

x = torch.randn(256)  # 1 KiB of float32
with Client(endpoint) as client:
    for _ in range(warmup):
        client.infer("w1", x)
    control("-i", "on")
    for _ in range(count):
        client.infer("w1", x)
    control("-d")
    control("-i", "off")
"""


def identity_daemon(workdir: Path, side: str, tree: Path, workers: int):
    """(runtime folder, workload, config text) of a daemon of ``tree`` serving a 1 KiB identity
    model as "w1" with ``workers`` workers: the round trips the client and worker rows count."""
    from bench import serving

    workloads = serving.make_workloads(["W1"])
    workload = dataclasses.replace(workloads["W1"], inputs=[torch.randn(256)], kind="identity",
                                   kwargs={})
    runtime = workdir / side / tree.name
    runtime.mkdir(parents=True)
    text = serving.mw_config_text(runtime / "run", {"W1": workload}, None).replace(
        f'python_path = ["{ROOT}"]', f'python_path = ["{tree}"]').replace(
        "workers = 2", f"workers = {workers}")
    return runtime, workload, text


def client(workdir: Path, tree: Path, requests: int, local: bool = False) -> int:
    """Instructions per sequential 1 KiB round trip in a client process of ``tree``, against a
    daemon of the same tree (running natively): the client's codec, its sockets, its poll.
    ``local``: on the daemon's ``unix://`` frontend (client/local.py: no libzmq in the client)."""
    from bench import serving

    runtime, workload, text = identity_daemon(workdir, "client-unix" if local else "client", tree, 2)
    if local:
        text, unix = serving.with_local_frontend(text, runtime / "run")
    daemon, endpoint = serving.start_daemon(runtime, "daemon", text, {"w1": workload}, tree=tree)
    if local:
        endpoint = unix
    out = runtime / "client.out"
    try:
        subprocess.run([*valgrind(out), sys.executable, "-c", CLIENT, endpoint, str(WARMUP),
                        str(requests)], cwd=tree, check=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": str(tree)})
        return latest_count(out) // requests
    finally:
        serving.stop_process(daemon)


# -- a worker's side of a 1 KiB round trip ------------------------------------------------------

def worker(workdir: Path, tree: Path, requests: int) -> int:
    """Instructions per sequential 1 KiB round trip in the one worker of an identity model, the
    daemon of ``tree`` and this process's client running natively: the worker's codec, its
    sockets, its poll, the model's call. The daemon spawns it (and multiprocessing's resource
    tracker, which counts nothing) under callgrind, through a script given as its executable."""
    from bench import serving
    from modelwarden.client.client import Client

    runtime, workload, text = identity_daemon(workdir, "worker", tree, 1)
    out = runtime / "worker.out"
    script = runtime / "python-under-callgrind"
    script.write_text(f'#!/bin/sh\nexec {" ".join(valgrind(out))}.%p {sys.executable} "$@"\n')
    script.chmod(0o755)
    # Under valgrind a worker starts in about 15 s (imports and warm-up, uninstrumented).
    daemon, endpoint = serving.start_daemon(runtime, "daemon", text, {"w1": workload}, tree=tree,
                                            ready_s=600, spawn_with=script)
    x = torch.randn(256)
    try:
        with Client(endpoint, timeout=300) as client:
            for _ in range(WARMUP):
                client.infer("w1", x)
            pids = [int(path.name.rsplit(".", 1)[1]) for path in runtime.glob("worker.out.*")]
            for pid in pids:
                control(pid, "-i", "on")
            for _ in range(requests):
                client.infer("w1", x)
            for pid in pids:
                control(pid, "-d")
                control(pid, "-i", "off")
        dumps = [path for path in runtime.glob("worker.out.*.*")]
        return sum(total_instructions(dump) for dump in dumps) // requests
    finally:
        serving.stop_process(daemon)


def hottest(dump: Path, requests: int, top: int) -> list[tuple[int, str]]:
    """Our compiled functions with the most inclusive instructions per request: each by its
    module and name (``router.Router.accept_parsed``), once (Cython's wrapper that Python calls
    and the C function that does the work count the same instructions)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(dump)],
                          capture_output=True, text=True).stdout
    rows, seen = [], set()
    for line in text.splitlines():
        match = re.match(r"\s*([0-9,]+) \(\s*[0-9.]+%\)\s+\S*?:(__pyx_(?:pw|f|pf)_\S+)", line)
        if not match or "modelwarden" not in match.group(2):
            continue
        name = readable(match.group(2))
        if name in seen:
            continue
        seen.add(name)
        rows.append((int(match.group(1).replace(",", "")) // requests, name))
    return rows[:top]


def readable(symbol: str) -> str:
    """``__pyx_f_11modelwarden_10supervisor_7routing_6router_6Router_accept_parsed`` ->
    ``supervisor.routing.router.Router.accept_parsed``: Cython writes each enclosing name as its
    length and itself, the function's own name bare (or after a counter, in a wrapper's name)."""
    rest = re.sub(r"^__pyx_(?:pw|f|pf)_", "", symbol).split("'")[0].split(".")[0]
    parts = []
    while True:
        match = re.match(r"(\d+)(.*)", rest)
        if not match:
            break
        length, after = int(match.group(1)), match.group(2)
        if len(after) < length or (len(after) > length and after[length] != "_"):
            rest = after  # a counter before the function's own name, not a length
            break
        parts.append(after[:length])
        rest = after[length + 1:]
    return ".".join([part for part in parts if part != "modelwarden"] + ([rest] if rest else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--client-requests", type=int, default=1000,
                        help="sequential round trips counted in the client and worker rows")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--skip-uncompiled", action="store_true")
    parser.add_argument("--against", type=Path,
                        help="another checkout (compiled in place), measured side by side: the "
                             "commit before a change, for its ratio")
    parser.add_argument("--json", type=Path, help="write the rows and the targets here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind): nothing measured")
        return 1
    from bench.machine import command, machine
    from modelwarden import compiled
    from modelwarden.testing import copy_checkout

    workdir = Path(tempfile.mkdtemp(prefix="mw-instructions-"))
    trees = {"compiled": ROOT}
    if compiled.COMPILED_STATE not in compiled.report().values():
        print("note: this tree runs uncompiled (make compile): its row says so")
        trees = {"uncompiled": ROOT}
    elif not args.skip_uncompiled:
        copy_checkout(ROOT, workdir / "uncompiled")
        trees["uncompiled"] = workdir / "uncompiled"
    if args.against is not None:
        trees["against"] = importable(args.against.resolve())
    rows = {"floor": floor(workdir, args.requests)}
    base = rows["floor"]
    print(f"{'row':<50}{'instructions/request':>22}{'x floor':>9}")
    print(f"{'floor: C zmq.proxy, 1 KiB, 8 in flight':<50}{base:>22,}{1.0:>9.2f}")
    # This checkout's clients also on the local frontend (unix://): the rows "..., compiled, unix".
    local = ["compiled"] if "compiled" in trees else []
    for batching in (None, {"max_size": 16, "max_delay_us": 0}):
        for kind, tree, over_unix in [*((kind, tree, False) for kind, tree in trees.items()),
                                      *((kind, trees[kind], True) for kind in local)]:
            key = f"supervisor batching {'on' if batching else 'off'}, {kind}{UNIX if over_unix else ''}"
            rows[key] = supervisor(workdir, tree, batching, args.requests, local=over_unix)
            print(f"{'supervisor W1@' + str(IN_FLIGHT) + ', ' + key[11:]:<50}{rows[key]:>22,}"
                  f"{rows[key] / base:>9.2f}")
    for side, measure in (("client", client), ("worker", worker)):
        for kind, tree in trees.items():
            key = f"{side}, {kind}"
            rows[key] = measure(workdir, tree, args.client_requests)
            print(f"{side + ', 1 KiB round trip, ' + kind:<50}{rows[key]:>22,}")
    for kind in local:  # the worker's side does not depend on the client's frontend
        key = f"client, {kind}{UNIX}"
        rows[key] = client(workdir, trees[kind], args.client_requests, local=True)
        print(f"{'client, 1 KiB round trip, ' + kind + UNIX:<50}{rows[key]:>22,}")
    report = targets(rows)
    print()
    for row in report:
        print(f"{'MET ' if row['met'] else 'MISS'} {row['target']:58s} {row['value']:.2f} "
              f"(target {row['op']} {row['bound']})")
    if "compiled" in trees:
        dumps = sorted((workdir / "off" / ROOT.name).glob("supervisor.out.*"))
        if dumps:
            print("\nwhere the compiled supervisor's instructions go (batching off, inclusive, per request):")
            for count, name in hottest(dumps[-1], args.requests, args.top):
                print(f"{count:>10,}  {name}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), "command": command(),
                                         "requests": args.requests, "in_flight": IN_FLIGHT,
                                         "rows": rows, "targets": report}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def importable(tree: Path) -> Path:
    """``tree`` (a checkout compiled in place) importable as ``modelwarden`` with PYTHONPATH:
    its role folders linked under ``modelwarden/``, as pyproject's package-dir maps them."""
    import tomllib

    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for role in {folder.split("/")[0] for package, folder in package_dir.items()
                 if package.count(".") == 1}:
        link = tree / "modelwarden" / role
        if not link.exists():
            link.symlink_to(tree / role, target_is_directory=True)
    return tree


def targets(rows: dict) -> list[dict]:
    """Issue 24's targets that instruction counts can state, each as a ratio within this run."""
    out = []

    def check(target: str, value: float | None, op: str, bound: float) -> None:
        if value is not None:
            met = value <= bound if op == "<=" else value >= bound
            out.append({"target": target, "value": round(value, 3), "op": op, "bound": bound,
                        "met": met})

    floor_count = rows["floor"]
    for on, bound in (("off", 2.5), ("on", 1.5)):
        for over in ("", UNIX):
            ours = rows.get(f"supervisor batching {on}, compiled{over}")
            check(f"supervisor W1@{IN_FLIGHT}, batching {on}{over} / C proxy floor",
                  ours / floor_count if ours else None, "<=", bound)
            for other in ("uncompiled", "against"):  # both over ipc://
                theirs = rows.get(f"supervisor batching {on}, {other}")
                if ours and theirs:
                    check(f"supervisor W1@{IN_FLIGHT}, batching {on}: compiled{over} / {other}",
                          ours / theirs, "<=", 1.0)
    for side, overs in (("client", ("", UNIX)), ("worker", ("",))):
        for over in overs:
            ours = rows.get(f"{side}, compiled{over}")
            for other in ("uncompiled", "against"):  # both over ipc://
                theirs = rows.get(f"{side}, {other}")
                if ours and theirs:
                    check(f"{side}, 1 KiB round trip: compiled{over} / {other}", ours / theirs,
                          "<=", 0.4)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
