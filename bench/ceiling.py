"""The supervisor's ceiling: its CPU per request against a C zmq.proxy's, in alternating rounds.

    python bench/ceiling.py [--rounds N] [--against CHECKOUT | --against-uncompiled] [--quick]
                            [--json PATH]

Issue 24's supervisor targets are ratios of CPU time, and CPU time on this 2-core machine moves
by a third from one minute to the next (the load generator, the workers and the supervisor share
the cores; the host's other tenants share the hardware). One run of bench/serving.py measures
each number once. This measures them N times, in turns, and states the medians:

* per round, W1 (MLP 64 -> 256 -> 10, [1, 64]) at 64 requests in flight to two workers, for
  4 s after a 1 s warm-up, batching off and on (max 16, no delay), each on a daemon started for
  it: the supervisor's CPU per request (user + system, every thread, /proc/PID/stat), as
  bench/serving.py measures it, the requests/s its clients were served, and the CPU per request
  of the load generator's process and of the workers (where the rest of the cores went);
* the same two points for this checkout's clients on the local frontend (``unix://``,
  supervisor/routing/localfront.py: no libzmq I/O thread between the client and the loop),
  on a daemon serving both frontends, measured over ``unix://`` (rows ``this off unix``...);
* in the same round, the floor: a C ``zmq.proxy`` broker's CPU per 1 KiB request at 8 in flight
  (ROUTER -> DEALER, REQ clients, REP echoes: bench/payloads.py's ``bench_proxy_cpu``);
* with ``--against``, the same two points for another checkout compiled in place (``git
  worktree add /tmp/base COMMIT``, then ``python setup.py build_ext --inplace`` there), in the
  same round, right after this checkout's: the commit before a change, side by side; or with
  ``--against-uncompiled`` a copy of this checkout without its compiled modules, whose points a
  process of that copy measures: the daemon, its workers and the load generator's client all on
  the uncompiled path. (With ``--against`` the load generator is this process's client.)

Prints every round, then per build, batching setting and transport the median CPU per request,
the median of the rounds' ratios to the floor, and the requests/s one supervisor core routes at
the median (1e6 / µs); then issue 24's targets (batching off <= 2.5x the floor, on <= 1.5x; one
core routes >= 25,000 and >= 50,000 requests/s) over ipc:// and over unix://, MET or MISS, and
with ``--against`` this build's
median CPU over the other's and the median of the rounds' ratios of requests/s served (issue
24: >= 1.5x with batching on, against the uncompiled path or the checkout before the change). ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import serving  # noqa: E402
from bench.instructions import importable  # noqa: E402
from bench.machine import command, commit_of, machine  # noqa: E402
from bench.payloads import bench_proxy_cpu  # noqa: E402

IN_FLIGHT = 64
FLOOR_IN_FLIGHT = "8"
CONFIGS = (("off", None), ("on", {"max_size": serving.BATCH_MAX, "max_delay_us": 0}))
# Issue 24: (the floor ratio at most, the requests/s one core routes at least)
TARGETS = {"off": (2.5, 25_000), "on": (1.5, 50_000)}
# Issue 24: W1 at 64 in flight, batching on, serves >= 1.5x the requests/s of the uncompiled path
# (or of the checkout before the change)
SERVED_OVER_BEFORE = {"on": 1.5}
# A point's numbers besides the supervisor's CPU, each a row key "<tree> <config> <part>"
POINT_PARTS = ("served", "client", "workers")
LOCAL = "unix"  # a point over the local frontend: "this <config> unix"


def supervisor_point(workdir: Path, tree: Path, batching: dict | None,
                     timing: serving.Timing, local: bool = False) -> dict:
    """What ``tree`` serving W1 at IN_FLIGHT did, on a daemon started for this point alone:
    ``cpu`` the supervisor's CPU per request (µs), ``served`` the requests/s the clients were
    served, and the CPU per request of the ``client`` (this process: the load generator and
    its client) and of the ``workers`` (both, together). ``local``: the clients on the
    daemon's ``unix://`` frontend instead of its ``ipc://`` one."""
    workloads = serving.make_workloads(["W1"])
    text = serving.mw_config_text(workdir / "run", workloads, batching).replace(
        f'python_path = ["{ROOT}"]', f'python_path = ["{tree}"]')
    if local:
        text, unix = serving.with_local_frontend(text, workdir / "run")
    daemon, endpoint = serving.start_daemon(workdir, "ceiling", text, {"w1": workloads["W1"]},
                                            tree=tree)
    if local:
        endpoint = unix
    try:
        result = serving.mw_point(endpoint, "w1", workloads["W1"], IN_FLIGHT, timing, daemon.pid,
                                  split=True)
    finally:
        serving.stop_process(daemon)
        shutil.rmtree(workdir / "run", ignore_errors=True)
    if result["errors"] or "supervisor_cpu_us" not in result:
        raise RuntimeError(f"the W1 point of {tree} failed: {result}")
    return {"cpu": result["supervisor_cpu_us"], "served": result["rps"],
            "client": result["client_cpu_us"], "workers": result["workers_cpu_us"]}


def point_in(workdir: Path, tree: Path, batching: dict | None,
             timing: serving.Timing) -> dict:
    """``supervisor_point`` for a copy of this checkout without its compiled modules, measured by
    a process of that copy (``--point``): the load generator's client runs uncompiled too, as a
    user of the uncompiled path would run it."""
    request = {"workdir": str(workdir), "batching": batching,
               "timing": [timing.warmup_s, timing.duration_s]}
    done = subprocess.run([sys.executable, str(tree / "bench" / "ceiling.py"), "--point",
                           json.dumps(request)], cwd=tree, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise RuntimeError(f"the uncompiled point failed:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.splitlines()[-1])
    path = answer.pop("request_path")
    if "uncompiled" not in path or "compiled (" in path:
        raise RuntimeError(f"the copy's client did not run uncompiled: {path}")
    return answer


def point_here(argument: str) -> int:
    """``--point JSON``: one point of this tree, measured in this process; one JSON line."""
    from modelwarden import compiled

    request = json.loads(argument)
    point = supervisor_point(Path(request["workdir"]), ROOT, request["batching"],
                             serving.Timing(*request["timing"]))
    print(json.dumps({**point, "request_path": compiled.summary()}))
    return 0


def run_rounds(trees: dict[str, Path], rounds: int, timing: serving.Timing,
               floor_requests: int, uncompiled: bool = False) -> list[dict]:
    """Each round: every tree's two points, then the floor. ``uncompiled``: the other tree is
    an uncompiled copy of this one, whose points its own process measures (``point_in``)."""
    spawn = multiprocessing.get_context("spawn")
    out = []
    for number in range(1, rounds + 1):
        workdir = Path(tempfile.mkdtemp(prefix="mwceil-", dir="/tmp"))
        try:
            row = {"round": number}
            for name, tree in trees.items():
                for config, batching in CONFIGS:
                    measure = point_in if uncompiled and name == "against" else supervisor_point
                    point = measure(workdir, tree, batching, timing)
                    row[f"{name} {config}"] = point["cpu"]
                    for part in POINT_PARTS:
                        row[f"{name} {config} {part}"] = point[part]
            for config, batching in CONFIGS:  # this checkout's clients on unix://
                point = supervisor_point(workdir, ROOT, batching, timing, local=True)
                row[f"this {config} {LOCAL}"] = point["cpu"]
                for part in POINT_PARTS:
                    row[f"this {config} {LOCAL} {part}"] = point[part]
            row["floor"] = bench_proxy_cpu(workdir, spawn, floor_requests)[FLOOR_IN_FLIGHT]["proxy_cpu_us"]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"round {number}: " + ", ".join(
            f"{key} {value} {'req/s' if key.endswith('served') else 'us'}"
            for key, value in row.items() if key != "round"), flush=True)
        out.append(row)
    return out


def point_keys(rows: list[dict], trees: dict[str, Path]) -> list[str]:
    """The points the rows measured: each build and setting over ipc://, and this build's over
    unix:// (``this off unix``...) where the rows have them."""
    keys = [f"{name} {config}" for name in trees for config, _ in CONFIGS]
    return keys + [f"this {config} {LOCAL}" for config, _ in CONFIGS
                   if f"this {config} {LOCAL}" in rows[0]]


def summarise(rows: list[dict], trees: dict[str, Path]) -> dict:
    """Per build, setting and transport: the median CPU per request, the median of the rounds'
    ratios to their floor, and what one core routes at that median."""
    summary = {"floor_us": statistics.median(row["floor"] for row in rows)}
    for key in point_keys(rows, trees):
        cpu = [row[key] for row in rows]
        ratios = [row[key] / row["floor"] for row in rows]
        summary[key] = {"cpu_us": cpu, "median_us": statistics.median(cpu),
                        "ratios": [round(value, 3) for value in ratios],
                        "median_ratio": round(statistics.median(ratios), 3),
                        "requests_per_s": round(1e6 / statistics.median(cpu)),
                        "served": [row[f"{key} served"] for row in rows],
                        "median_served": statistics.median(row[f"{key} served"] for row in rows),
                        # where the rest of the 2 cores went, per request (µs)
                        "median_client_us": statistics.median(row[f"{key} client"] for row in rows),
                        "median_workers_us": statistics.median(row[f"{key} workers"] for row in rows)}
    return summary


def targets(summary: dict, rows: list[dict], against: bool) -> list[dict]:
    report = []
    for config, (bound, ceiling) in TARGETS.items():
        for suffix, over in (("", ""), (f" {LOCAL}", ", clients over unix://")):
            ours = summary.get(f"this {config}{suffix}")
            if ours is None:
                continue
            report.append({"target": f"supervisor CPU / C proxy CPU at {FLOOR_IN_FLIGHT} in "
                                     f"flight, batching {config}{over} (median of the rounds)",
                           "value": ours["median_ratio"], "op": "<=", "bound": bound,
                           "met": ours["median_ratio"] <= bound})
            report.append({"target": f"requests/s one supervisor core routes, batching "
                                     f"{config}{over} (at the median CPU)",
                           "value": ours["requests_per_s"], "op": ">=", "bound": ceiling,
                           "met": ours["requests_per_s"] >= ceiling})
        ours = summary[f"this {config}"]
        if against:
            theirs = summary[f"against {config}"]
            report.append({"target": f"this build's median CPU / the other's, batching {config}",
                           "value": round(ours["median_us"] / theirs["median_us"], 3),
                           "op": "", "bound": None, "met": None})
            # Issue 24 asks it of batching on (>= 1.5x the uncompiled path or the checkout before
            # the change); off is stated beside it. The median of the rounds' own ratios: a round measures both.
            served = statistics.median(row[f"this {config} served"] / row[f"against {config} served"]
                                       for row in rows)
            bound = SERVED_OVER_BEFORE.get(config)
            report.append({"target": f"W1@{IN_FLIGHT} requests/s served, this build / the other, "
                                     f"batching {config} (median of the rounds' ratios)",
                           "value": round(served, 3), "op": ">=" if bound else "", "bound": bound,
                           "met": served >= bound if bound else None})
            if f"this {config} {LOCAL}" in summary:  # stated beside it: a transport, not a build
                served = statistics.median(row[f"this {config} {LOCAL} served"]
                                           / row[f"against {config} served"] for row in rows)
                report.append({"target": f"W1@{IN_FLIGHT} requests/s served, this build over "
                                         f"unix:// / the other over ipc://, batching {config}",
                               "value": round(served, 3), "op": "", "bound": None, "met": None})
    return report


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    against = parser.add_mutually_exclusive_group()
    against.add_argument("--against", type=Path,
                         help="another checkout, compiled in place, measured in the same rounds")
    against.add_argument("--against-uncompiled", action="store_true",
                         help="measure a copy of this checkout without its compiled modules in "
                              "the same rounds (the daemon and its workers run the .py files)")
    parser.add_argument("--quick", action="store_true",
                        help="0.3 s + 1.2 s per point and a shorter floor (a smoke run)")
    parser.add_argument("--json", type=Path, help="write the rounds, medians and targets here")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # point_in's child: one point, JSON
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.point is not None:
        return point_here(args.point)
    timing = serving.Timing(0.3, 1.2) if args.quick else serving.Timing(1.0, 4.0)
    trees = {"this": ROOT}
    scratch = None
    if args.against is not None:
        trees["against"] = importable(args.against.resolve())
    elif args.against_uncompiled:
        from modelwarden.testing import copy_checkout

        scratch = Path(tempfile.mkdtemp(prefix="mwceil-uncompiled-", dir="/tmp"))
        copy_checkout(ROOT, scratch / "tree")
        trees["against"] = scratch / "tree"
    started = time.monotonic()
    measured_on = machine()
    try:
        rows = run_rounds(trees, args.rounds, timing, 2000 if args.quick else 20000,
                          uncompiled=args.against_uncompiled)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarise(rows, trees)
    report = targets(summary, rows, "against" in trees)
    print(f"\nthe floor, median: {summary['floor_us']} us per request")
    for key in point_keys(rows, trees):
        row = summary[key]
        name, config, *over = key.split()
        print(f"{name} ({trees[name]}), batching {config}{' over unix://' if over else ''}: "
              f"median {row['median_us']} us per request, "
              f"{row['median_ratio']}x the floor (rounds: {row['ratios']}); one core routes "
              f"about {row['requests_per_s']:,} requests/s; served {row['median_served']:,} "
              f"requests/s (rounds: {row['served']}); CPU per request elsewhere: client "
              f"{row['median_client_us']} us, workers {row['median_workers_us']} us")
    for line in report:
        verdict = "----" if line["met"] is None else ("MET " if line["met"] else "MISS")
        bound = f" (target {line['op']} {line['bound']:,})" if line["bound"] is not None else ""
        print(f"{verdict} {line['target']}: {line['value']:,}{bound}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": measured_on, "command": command(),
            "trees": {name: str(tree) for name, tree in trees.items()},
            "commits": {name: commit_of(tree) for name, tree in trees.items()},
            "against_uncompiled": args.against_uncompiled,
            "timing": {"warmup_s": timing.warmup_s, "duration_s": timing.duration_s},
            "in_flight": IN_FLIGHT, "rounds": rows, "summary": summary, "targets": report,
            "elapsed_s": round(time.monotonic() - started, 1)}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
