"""docs/BENCHMARKS.md and its figures, drawn from the JSON the benchmarks wrote.

    python bench/report.py [--results docs/results] [--doc docs/BENCHMARKS.md] [--img docs/img]
    make report          # the same, after installing the bench extra (matplotlib)
    make report-data     # run every benchmark below into docs/results/, then this

Each benchmark writes its measurements, the machine it ran on and the command that ran it
(bench/machine.py) as JSON: serving.json (bench/serving.py), recovery.json (bench/recovery.py),
memory.json (bench/memory.py), payloads.json (bench/payloads.py), soak.json (bench/soak.py),
text.json (bench/text.py), instructions.json (bench/instructions.py), ceiling.json
(bench/ceiling.py), cpu_round_trip.json (bench/payloads.py --cpu-against).
The JSON in docs/results/ is committed beside the figures it drew, so this script regenerates
the document without running anything; a file that is missing makes its section say how to
measure it. Every number in the document comes from those files; the prose around them is here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("mosec", "litserve", "ray", "pytriton")
PEER_NAMES = {"mosec": "mosec", "litserve": "LitServe", "ray": "Ray Serve", "pytriton": "PyTriton"}
LOCAL = "modelwarden-local"  # bench/serving.py's rows of modelwarden on its local frontend
COLOURS = {"modelwarden": "tab:blue", LOCAL: "tab:cyan", "in-process": "tab:gray", "mosec": "tab:orange",
           "litserve": "tab:green", "ray": "tab:red", "pytriton": "tab:purple"}
PNG = {"dpi": 110, "metadata": {"Software": None}}  # no version stamp: the same data, the same file


# -- reading ------------------------------------------------------------------------------------


def save(fig, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, **PNG)
    plt.close(fig)


def not_measured(command: str) -> list[str]:
    return [f"Not measured: run `{command}`.", ""]


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(data: dict) -> str:
    """Where and when it ran, and what ran it: the caption every figure gets."""
    m = data.get("machine") or {}
    if "cpu_model" not in m:
        return "machine not recorded (a JSON from before bench/machine.py)"
    memory = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "memory unknown"
    load_avg = m.get("load_average") or [None]
    return (f"{m['cores']} cores ({m['cpu_model']}), {memory} of memory, Linux {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}; {m['date']}; load average "
            f"{load_avg[0]} as the run {'ended' if m.get('recorded_at') == 'end' else 'began'} "
            f"(other work shared the cores: see \"Reading these numbers\"); commit "
            f"{m.get('commit')}")


def provenance(data: dict, figure: str | None = None) -> list[str]:
    lines = []
    if figure:
        lines.append(f"![{figure}](img/{figure}.png)")
        lines.append("")
    lines.append(f"Reproduce: `{data.get('command', 'not recorded')}`  ")
    lines.append(f"Measured on: {machine_line(data)}.")
    return lines


def ms(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} ms"


def rps(value) -> str:
    return "-" if not value else f"{value:,.0f}"


def ratio(a, b) -> float | None:
    return a / b if a and b else None


def times(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def verdict(met) -> str:
    return "not measured" if met is None else ("met" if met else "**missed**")


# -- serving ------------------------------------------------------------------------------------


def points(data: dict, system: str, workload: str, config: str | None = None,
           transport: str | None = None) -> list[dict]:
    return [p for p in data["points"] if p["system"] == system and p["workload"] == workload
            and (config is None or p["config"] == config)
            and (transport is None or p["transport"] == transport)]


def series(data: dict, workload: str) -> list[tuple[str, str, list[dict]]]:
    """(system, config, points by concurrency) for every line of a workload's figure."""
    found: dict[tuple[str, str], list[dict]] = {}
    for p in data["points"]:
        if p["workload"] == workload and p["system"] != "gateway" and p.get("rps"):
            found.setdefault((p["system"], p["config"]), []).append(p)
    order = {name: n for n, name in enumerate(["modelwarden", LOCAL, "in-process", *PEERS])}
    return [(system, config, sorted(rows, key=lambda p: p["concurrency"]))
            for (system, config), rows in sorted(found.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1]))]


def line_style(system: str, config: str) -> str:
    if "1 worker" in config:
        return "-."
    if "1000us" in config or system == "in-process" and config.startswith("queue"):
        return ":"
    return "--" if config.startswith("batch ") else "-"


def label(system: str, config: str) -> str:
    name = "modelwarden, unix://" if system == LOCAL else PEER_NAMES.get(system, system)
    return f"{name}, {config}"


def serving_figure(data: dict, workload: str, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for system, config, rows in series(data, workload):
        x = [p["concurrency"] for p in rows]
        style = dict(color=COLOURS.get(system, "black"), linestyle=line_style(system, config),
                     marker="o", markersize=4, label=label(system, config))
        left.plot(x, [p["rps"] for p in rows], **style)
        right.plot(x, [p["p99_ms"] for p in rows], **style)
    info = data["workloads"][workload]
    for axis, name in ((left, "requests/s"), (right, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("requests in flight (closed loop)")
        axis.set_ylabel(name)
        axis.set_xticks(sorted({p["concurrency"] for p in data["points"]}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{workload}: {info['title']}; 2 workers x 1 thread each (throughput left, p99 right)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, out)


def best(rows: list[dict], key: str = "rps", low: bool = False) -> dict | None:
    rows = [p for p in rows if p.get(key) is not None and p.get("rps")]
    if not rows:
        return None
    return (min if low else max)(rows, key=lambda p: p[key])


def peer_best(data: dict, workload: str, concurrency: int, batched: bool) -> dict | None:
    return best([p for name in PEERS for p in points(data, name, workload)
                 if p["concurrency"] == concurrency and p["config"].startswith("batch ") == batched])


def mw_best(data: dict, workload: str, concurrency: int, batched: bool,
            system: str = "modelwarden") -> dict | None:
    """modelwarden's best 2-worker point there, over ZeroMQ or (``system`` LOCAL) not."""
    return best([p for p in points(data, system, workload) if p["concurrency"] == concurrency
                 and "1 worker" not in p["config"] and p["config"].startswith("batch ") == batched])


def cell(p: dict | None, who: bool = False) -> str:
    if p is None:
        return "-"
    name = f"{PEER_NAMES.get(p['system'], p['system'])} " if who else ""
    return f"{name}{rps(p['rps'])} ({ms(p.get('p50_ms'))} / {ms(p.get('p99_ms'))})"


def serving_table(data: dict) -> list[str]:
    rows = []
    for workload in data["workloads"]:
        for concurrency in sorted({p["concurrency"] for p in data["points"] if p["workload"] == workload}):
            lock = [p for p in points(data, "in-process", workload)
                    if p["concurrency"] == concurrency and p["config"].startswith("lock")]
            rows.append([workload, str(concurrency), cell(mw_best(data, workload, concurrency, False)),
                         cell(mw_best(data, workload, concurrency, True)),
                         cell(peer_best(data, workload, concurrency, False), who=True),
                         cell(peer_best(data, workload, concurrency, True), who=True),
                         cell(lock[0] if lock else None)])
    return table(["load", "in flight", "modelwarden, batching off", "modelwarden, batching on (best)",
                  "best peer, batching off", "best peer, batching on", "one model + lock, in-process"],
                 rows)


def local_table(data: dict) -> list[str]:
    """modelwarden on its local frontend against ZeroMQ, point by point (the same daemon)."""
    rows = []
    for workload in data["workloads"]:
        for concurrency in sorted({p["concurrency"] for p in points(data, LOCAL, workload)}):
            cells = [cell(mw_best(data, workload, concurrency, batched, system))
                     for batched in (False, True) for system in ("modelwarden", LOCAL)]
            rows.append([workload, str(concurrency), *cells])
    if not rows:
        return []
    return table(["load", "in flight", "ZeroMQ (ipc://), batching off",
                  "local frontend (unix://), batching off", "ZeroMQ, batching on (best)",
                  "local frontend, batching on (best)"], rows)


def point_errors(data: dict, systems: tuple) -> list[str]:
    """Each point of these systems that got a failed answer or none at all, with its first
    error: nothing of a run is left out of the document."""
    bad = [p for p in data["points"] if (p.get("errors") or not p.get("rps")) and p["system"] in systems]
    if not bad:
        return ["Every answer checked in these points was right: no errors."]
    lines = [f"{len(bad)} of these points had failed answers, or none:", ""]
    for p in bad:
        where = f"{PEER_NAMES.get(p['system'], p['system'])} {p['transport']}, {p['config']}"
        if not p.get("ok") and not p.get("errors"):
            lines.append(f"* {p['workload']} at {p['concurrency']} in flight, {where}: no answer "
                         "within the window (nothing wrong was answered; nothing was answered)")
            continue
        first = " ".join((p.get("first_error") or "no error recorded").split())[:220]
        lines.append(f"* {p['workload']} at {p['concurrency']} in flight, {where}: "
                     f"{p.get('ok') or 0} answered, {p.get('errors')} errors; first: `{first}`")
    if any("over its share" in (p.get("first_error") or "") for p in bad):
        lines += ["", "An OVERLOADED (429) naming `identity_share` is the gateway's per-caller "
                  "share at work: the benchmark is one caller, and its 4 MiB requests in flight reach "
                  "the share the message names (`identity_share` of the gateway's "
                  "`max_bytes_in_flight`, by default 4 x `max_message_bytes`). A deployment whose "
                  "callers need more raises one of the two."]
    return lines


def targets_table(report: list[dict]) -> list[str]:
    rows = []
    for t in report:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        rows.append([t["target"], f"{t['op']} {t['bound']:g}", value, verdict(t["met"]), t["how"]])
    return table(["target", "bound", "measured", "", "how"], rows)


def find_target(report: list[dict], start: str) -> dict | None:
    return next((t for t in report if t["target"].startswith(start)), None)


def serving_missed(data: dict) -> list[str]:
    """Where the time goes, for each target of the run that is missed."""
    report, w = data["targets"], data["workloads"]
    notes = []
    t = find_target(report, "W2@64 batching on p99")
    if t and t["met"] is False:
        notes.append(
            f"*W2 p99 at 64 in flight*: with 64 in flight and 2 workers each taking batches of 16, "
            f"a request waits behind a whole batch of its worker and often a second one queued "
            f"(64 = 2 workers x 2 batches x 16), so p99 is about three batch times (3 x "
            f"{ms(w['W2']['batch_p50_ms'])} in-process, plus transport); the bound's two batch "
            f"times fit a load of at most 32 in flight.")
    t = find_target(report, "W2@1 p50")
    if t and t["met"] is False:
        depth = w["W2"]["kwargs"].get("depth")
        notes.append(
            f"*W2 at 1 in flight*: the forward itself is slower in a worker than in a hot loop "
            f"in-process ({ms(w['W2']['forward_p50_ms'])} back to back): the model's {depth} "
            f"layers of 512 x 512 float32 ({depth} MiB of weights) are evicted from the cache while "
            f"the client, the supervisor and the other worker run between requests. The router "
            f"sends ties to the most recently used worker so that the worker whose weights are "
            f"warm serves the next request.")
    t = find_target(report, "W2@8 2 workers")
    if t and t["met"] is False:
        two = mw_best(data, "W2", 8, False)
        share = (f" (the supervisor alone used {two['supervisor_cpu_us'] * two['rps'] / 1e6:.2f} "
                 "of a core at that rate)") if two and two.get("supervisor_cpu_us") else ""
        notes.append(
            "*2 workers against 1*: the machine's cores are shared by the 2 workers, the "
            f"supervisor{share} and the benchmark's client process, so a second worker finds no "
            "core of its own.")
    off = mw_best(data, "W1", 64, False)
    on = mw_best(data, "W1", 64, True)
    t = find_target(report, "W1@64 batching on / batching off")
    if t and t["met"] is False and off and on and off.get("supervisor_cpu_us") and on.get("supervisor_cpu_us"):
        notes.append(
            f"*W1 at 64 in flight, batching on against off*: the supervisor's CPU per request "
            f"(all its threads, from /proc/PID/stat) measured {off['supervisor_cpu_us']:.0f} us "
            f"with batching off and {on['supervisor_cpu_us']:.0f} us with it on, enough for "
            f"{1e6 / off['supervisor_cpu_us']:,.0f} and {1e6 / on['supervisor_cpu_us']:,.0f} "
            f"requests/s on one core; the two cores are shared with the two workers and the "
            f"load generator, whose client encodes, sends and decodes each request alone with "
            f"batching on as off, so the ratio is bounded by what is left to the supervisor and "
            f"the workers (bench/ceiling.py measures the supervisor's share alone).")
    over = [t for t in report if t["target"].startswith("W1@64 supervisor CPU us/request")
            and t["met"] is False]
    if over:
        notes.append(
            f"*The supervisor's CPU at W1@64*: {', '.join(t['target'] for t in over)} went over "
            f"60 us in this run; docs/ARCHITECTURE.md (\"Where the time goes\") counts what a "
            f"request costs the supervisor, and bench/ceiling.py measures it against a C broker "
            f"in rounds of its own.")
    t = find_target(report, "W1@1 p50 / best peer")
    if t and t["met"] is False:
        ours = mw_best(data, "W1", 1, False)
        local = mw_best(data, "W1", 1, False, LOCAL)
        there = (f"; on the local frontend (`unix://`) it took {ms(local['p50_ms'])}"
                 if local and local.get("p50_ms") else "")
        notes.append(
            f"*W1 at 1 in flight*: {ms(ours and ours['p50_ms'])} is two hops, client to "
            f"supervisor over `ipc://` (ZMTP, read and written by both ends themselves) and "
            f"supervisor to worker over a socket pair{there}. The fastest peer here "
            f"({t['how'].removeprefix('vs ')}) answers from a compiled front end with one hop to "
            f"its worker.")
    return notes


def serving_section(data: dict | None, img: Path) -> list[str]:
    out = ["## Serving under load, against the servers users would pick instead", ""]
    if data is None:
        return out + not_measured("python bench/serving.py --json docs/results/serving.json")
    timing = data["timing"]
    out += [
        f"`bench/serving.py` runs closed-loop clients at "
        f"{', '.join(str(c) for c in sorted({p['concurrency'] for p in data['points']}))} requests in "
        f"flight, each point a {timing['warmup_s']:g} s warm-up and a {timing['duration_s']:g} s "
        "window, on three workloads:", ""]
    for name, w in data["workloads"].items():
        extra = f", kwargs {w['kwargs']}" if w["kwargs"] else ""
        if w["kind"] == "identity":
            out.append(f"* **{name}** {w['title']}: the model returns its input; what is measured "
                       "is moving the tensor.")
            continue
        batch = f", a batch of 16 in {ms(w['batch_p50_ms'])}" if w.get("batch_p50_ms") else ""
        out.append(f"* **{name}** {w['title']}{extra}: one in-process forward on one thread "
                   f"{ms(w['forward_p50_ms'])}{batch}.")
    out += ["",
            "modelwarden runs over `ipc://` (and, in its own table below, over its local "
            "frontend) with 2 workers x 1 thread, batching off and with "
            "`max_size = 16` (`max_delay_us` 0 and 1000), plus one worker on W2. The peers serve "
            "the same weights with 2 workers (or replicas) x 1 thread over HTTP/1.1 keep-alive, "
            "batching off and on (16, 1 ms), each installed by the benchmark into its own "
            "virtualenv under `bench/.peers/` (never a dependency of ours):", ""]
    for name, peer in data.get("peers", {}).items():
        measured = any(p["system"] == name for p in data["points"])
        state = "measured" if measured else "**not measured** (see the notes below)"
        out.append(f"* {PEER_NAMES.get(name, name)} ({peer['transport']}; "
                   f"`{' '.join(peer['requirements'])}`): {state}.")
    out += ["",
            "The in-process rows are the alternatives of the background articles, in the "
            "benchmark's own process with torch on every core: one model behind a lock, and a "
            "queue served by one thread. Every 25th answer is checked against the in-process "
            "model; a mismatch counts as an error.", ""]
    for workload in data["workloads"]:
        name = f"serving-{workload}"
        serving_figure(data, workload, img / f"{name}.png")
        out += [f"### {workload}: throughput and p99 against requests in flight", ""]
        out += provenance(data, name) + [""]
    out += ["### The table", "",
            "Requests/s, then (p50 / p99). \"Batching on\" is the better of modelwarden's two "
            "batching configurations at that point; \"best peer\" the peer with the most "
            "requests/s there.", ""]
    out += serving_table(data) + [""]
    local = local_table(data)
    if local:
        out += ["### The local frontend against ZeroMQ's wire", "",
                "Each 2-worker point of modelwarden measured again, on the same daemon, with the "
                "clients on its local frontend (`unix://`: the one a client on the daemon's host "
                "takes by default). On both frontends the client and the supervisor read and "
                "write the socket themselves, with no libzmq: they differ in framing (ZMTP on "
                "`ipc://`). Requests/s, then (p50 / p99).", ""]
        out += local + [""]
    out += point_errors(data, ("modelwarden", LOCAL, "in-process", *PEERS))
    out += ["", "### Targets, as ratios within this run", "",
            "The benchmark prints these itself (PASS/MISS); ratios within one run hold better "
            "on a shared machine than any absolute number.", ""]
    out += targets_table([t for t in data["targets"]
                          if "gateway" not in t["target"] and "floor" not in t["target"]]) + [""]
    missed = serving_missed(data)
    if missed:
        out += ["### Where the time goes where a target is missed", ""]
        for note in missed:
            out += [note, ""]
    if data.get("notes"):
        out += ["### Notes from the run", ""] + [f"* {note}" for note in data["notes"]] + [""]
    return out


# -- the gateway --------------------------------------------------------------------------------


GATEWAY_TRANSPORTS = ("REST binary", "REST JSON", "gRPC", "gRPC perf_analyzer")


def gateway_figure(data: dict, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    lines = [("native client (ZeroMQ)", points(data, "modelwarden", "W1", "batching off"), "tab:blue")]
    colours = ["tab:cyan", "tab:olive", "tab:brown", "tab:pink"]
    for transport, colour in zip(GATEWAY_TRANSPORTS, colours):
        lines.append((f"gateway {transport}", points(data, "gateway", "W1", "batching off", transport), colour))
    for name in PEERS:
        lines.append((PEER_NAMES[name], points(data, name, "W1", "batching off"), COLOURS[name]))
    for name, rows, colour in lines:
        rows = sorted((p for p in rows if p.get("rps")), key=lambda p: p["concurrency"])
        if not rows:
            continue
        x = [p["concurrency"] for p in rows]
        style = dict(color=colour, marker="o", markersize=4, label=name,
                     linestyle="-" if name.startswith(("native", "gateway")) else "--")
        left.plot(x, [p["rps"] for p in rows], **style)
        right.plot(x, [p["p50_ms"] for p in rows], **style)
    for axis, name in ((left, "requests/s"), (right, "p50 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("requests in flight (closed loop)")
        axis.set_ylabel(name)
        axis.set_xticks(sorted({p["concurrency"] for p in data["points"]}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle("W1 through the KServe v2 gateway, batching off (throughput left, p50 right)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, out)


def at(rows: list[dict], concurrency: int) -> dict | None:
    return next((p for p in rows if p["concurrency"] == concurrency and p.get("rps")), None)


def gateway_table(data: dict, high: int) -> list[str]:
    native = [("native client (ZeroMQ)", "modelwarden", None)]
    gateway = [(f"gateway {t}", "gateway", t) for t in GATEWAY_TRANSPORTS]
    peers = [(PEER_NAMES[name], name, None) for name in PEERS]
    rows = []
    for title, system, transport in native + gateway + peers:
        every = points(data, system, "W1", transport=transport)
        off = [p for p in every if not p["config"].startswith("batch ")]
        on = [p for p in every if p["config"].startswith("batch ") and "1 worker" not in p["config"]]
        one = at(off, 1)
        if not every:
            continue
        rows.append([title, ms(one and one["p50_ms"]), rps((at(off, high) or {}).get("rps")),
                     rps(max((p["rps"] for p in on if p["concurrency"] == high and p.get("rps")),
                             default=None))])
    return table(["W1 (MLP, [1, 64])", "1 in flight p50", f"{high} in flight, batching off",
                  f"{high} in flight, batching on (best)"], rows)


def gateway_section(data: dict | None, img: Path) -> list[str]:
    out = ["## The KServe v2 gateway", ""]
    if data is None or not any(p["system"] == "gateway" for p in data["points"]):
        note = next((n for n in (data or {}).get("notes", []) if n.startswith("gateway")), None)
        return out + [f"Not measured{': ' + note if note else ''}. Run `python bench/serving.py "
                      "--json docs/results/serving.json` with the `gateway` and `gateway-test` "
                      "extras installed.", ""]
    high = max(p["concurrency"] for p in data["points"])
    gateway_figure(data, img / "gateway-W1.png")
    out += ["The same run drives the gateway (2 workers x 1 thread, batching off and on) over "
            "REST with JSON tensors, REST with the binary tensor data extension (what "
            "tritonclient's HTTP client sends), gRPC through tritonclient (`grpc` at 1 in flight, "
            "`grpc.aio` above), and gRPC through Triton's `perf_analyzer`, a C++ client, where its "
            "binary runs. The load generator shares the cores with the daemon.", ""]
    out += provenance(data, "gateway-W1") + [""]
    out += gateway_table(data, high) + [""]
    out += point_errors(data, ("gateway",)) + [""]
    report = data["targets"]
    out += targets_table([t for t in report if "gateway" in t["target"] or "floor" in t["target"]]) + [""]
    empty = at(points(data, "gateway", "W1", transport="gRPC empty call"), 1)
    native = at(points(data, "modelwarden", "W1", "batching off"), 1)
    grpc = find_target(report, "W1@1 gateway gRPC p50 / native")
    if grpc and grpc["met"] is False and empty and native:
        out += [
            "**Where the time goes at 1 in flight over gRPC.** The gateway is its own process and "
            "an ordinary client of the daemon's frontend, so every gRPC request costs one gRPC "
            "round trip plus one native round trip. The gRPC round trip alone, an empty "
            f"`ServerLive` call answered by the gateway itself, took {ms(empty['p50_ms'])} here "
            f"against the native round trip's {ms(native['p50_ms'])}: even a gateway doing no work "
            f"of its own would be {times(ratio(empty['p50_ms'] + native['p50_ms'], native['p50_ms']))} "
            "the native p50. That floor is Python's gRPC server (grpcio's transport)."]
        full = at(points(data, "gateway", "W1", "batching off", "gRPC perf_analyzer"), 1)
        if full:
            rest = full["p50_ms"] - empty["p50_ms"] - native["p50_ms"]
            out[-1] += (f" A whole call through perf_analyzer took {ms(full['p50_ms'])}, "
                        f"{ms(rest)} over that floor: the gateway's own decoding, "
                        "`AsyncClient.infer` and encoding, and the C++ client's share.")
        out.append("")
        compiled = at(points(data, "gateway", "W1", transport="gRPC C++ empty server"), 1)
        if compiled:
            out += [
                "What a compiled gRPC front would start from: `bench/grpc_floor.cc`, Google's C++ "
                "gRPC server answering with the gateway's own canned answers, measured through "
                f"perf_analyzer: {ms(compiled['p50_ms'])} per call, so native + that is "
                f"{times(ratio(compiled['p50_ms'] + native['p50_ms'], native['p50_ms']))} the "
                "native p50. Meeting the target needs a gRPC front in C++ or Rust (its toolchain, "
                "platform wheels, and a second implementation of the native protocol).", ""]
        else:
            note = next((n for n in data.get("notes", []) if "C++" in n or "perf_analyzer" in n), None)
            if note:
                out += [f"The compiled floor (`bench/grpc_floor.cc`) was not measured: {note}.", ""]
    w3 = {t: at(points(data, "gateway", "W3", "batching off", t), 1) for t in ("REST binary", "gRPC")}
    w3_native = at(points(data, "modelwarden", "W3", "batching off"), 1)
    if any(w3.values()) and w3_native:
        out += [
            f"W3 (4 MiB) at 1 in flight: native {ms(w3_native['p50_ms'])}, REST binary "
            f"{ms((w3['REST binary'] or {}).get('p50_ms'))}, gRPC {ms((w3['gRPC'] or {}).get('p50_ms'))}: "
            "over HTTP the tensor is copied into and out of the request body; from the gateway to "
            "the worker it stays in shared memory.", ""]
    return out


# -- recovery -----------------------------------------------------------------------------------


def recovery_figure(data: dict, out: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    colours = {0: "tab:red", 1: "tab:blue"}
    for run in data["runs"]:
        line = run["timeline"]
        t0, width = line["start_s"], line["bin_s"]
        x = [t0 + width * (n + 0.5) for n in range(len(line["rps"]))]
        name = f"standby = {run['standby']}"
        colour = colours.get(run["standby"], "black")
        top.plot(x, line["rps"], color=colour, label=name, linewidth=1)
        top.axvline(run["kill_to_ready_ms"] / 1000, color=colour, linestyle=":", linewidth=1)
        width99 = line["p99_bin_s"]
        x99 = [t0 + width99 * (n + 0.5) for n in range(len(line["p99_ms"]))]
        bottom.plot(x99, line["p99_ms"], color=colour, marker="o", markersize=3, label=name)
    for axis in (top, bottom):
        axis.axvline(0, color="black", linewidth=1)
        axis.grid(True, alpha=0.3)
    top.set_ylabel(f"answers/s ({data['runs'][0]['timeline']['bin_s']:g} s bins)")
    top.set_ylim(bottom=0)
    bottom.set_ylabel("p99 latency (ms)")
    bottom.set_yscale("log")
    bottom.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    bottom.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bottom.set_xlabel("seconds from the SIGKILL (black); dotted: slot 0 READY again")
    top.legend(loc="lower left")
    fig.suptitle("SIGKILL of a READY worker under load: 2 workers x 1 core, with and without a warm standby")
    save(fig, out)


def recovery_section(data: dict | None, img: Path) -> list[str]:
    out = ["## What a crash costs: warm standby workers", ""]
    if data is None:
        return out + not_measured("python bench/recovery.py --json docs/results/recovery.json")
    s = data["settings"]
    recovery_figure(data, img / "recovery.png")
    out += [
        f"`bench/recovery.py` SIGKILLs the READY worker of slot 0 under load from {s['clients']} "
        f"closed-loop clients, on a model with a ~{s['load_seconds']:g} s load and 20 warm-up passes "
        f"(`bench.models:make_slow_loading`, {s['workers']} workers of 1 core), once with "
        "`standby = 0` and once with `standby = 1`. The workers have been up longer than "
        "`start_seconds`, so the kill is a crash, not a failed start. Before and after are the "
        f"{s['seconds']:g} s windows on either side of the kill.", ""]
    out += provenance(data, "recovery") + [""]
    rows = []
    for r in data["runs"]:
        rows.append([str(r["standby"]), f"{r['kill_to_ready_ms']:.0f} ms", rps(r["rps_before"]),
                     rps(r["rps_after"]), times(r["ratio"]), ms(r["p99_before_ms"]),
                     ms(r["p99_after_ms"]), f"{r['lost']} of {r['sent']}", str(r["errors"]),
                     "yes" if r["promoted"] else "no"])
    out += table(["standby", "kill -> slot READY", "req/s before", "req/s after", "after/before",
                  "p99 before", "p99 after", "lost", "typed errors", "standby promoted"], rows) + [""]
    with_standby = next((r for r in data["runs"] if r["standby"] >= 1), None)
    without = next((r for r in data["runs"] if r["standby"] == 0), None)
    if with_standby:
        out += table(["target (with a standby)", "bound", "measured", ""], [
            ["kill -> slot READY", "<= 100 ms", f"{with_standby['kill_to_ready_ms']:.0f} ms",
             verdict(with_standby["kill_to_ready_ms"] <= 100)],
            ["req/s after / before", ">= 0.9", times(with_standby["ratio"]),
             verdict(None if with_standby["ratio"] is None else with_standby["ratio"] >= 0.9)]]) + [""]
    if without:
        out += [f"Without a standby the slot is empty for the whole boot of its next worker "
                f"({without['kill_to_ready_ms'] / 1000:.1f} s here: spawn, `import torch`, the "
                "model's load, warm-up), and the other worker carries the load alone."]
    if with_standby:
        out += [
            "With one, the standby is promoted at once: re-pinned to the slot's cores, READY and "
            "routed to. What is left of the crash's cost in the window after it is the *next* "
            "standby's boot (spawn, import, load, warm-up: about 1.5 CPU-seconds) on the cores the "
            "serving workers use; it boots at nice 10 where the daemon may restore nice 0 on "
            "promotion (root, CAP_SYS_NICE, or the unit's `LimitNICE=+0`), else at normal priority."]
    return out + [""]


# -- memory -------------------------------------------------------------------------------------


def memory_figure(data: dict, out: Path) -> None:
    runs = list(data["pss_bytes"])
    workers = data["workers"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(runs)
    colours = {"runtime": "tab:gray", "load": "tab:red", "mmap": "tab:blue"}
    for n, name in enumerate(runs):
        values = [v / 1e6 for v in data["pss_bytes"][name]]
        left.bar([w + (n - (len(runs) - 1) / 2) * width for w in range(workers)], values, width,
                 label=name, color=colours.get(name))
    left.set_xticks(range(workers), [f"worker {w}" for w in range(workers)])
    left.set_ylabel("PSS (MB)")
    left.set_title("each worker's proportional set size")
    left.legend()
    totals = [sum(data["pss_bytes"][name]) / 1e6 for name in runs]
    right.bar(runs, totals, color=[colours.get(name) for name in runs])
    right.axhline(data["target_bytes"] / 1e6, color="black", linestyle="--", label="mmap target")
    right.set_ylabel("total PSS (MB)")
    right.set_title(f"{workers} workers in all")
    right.legend()
    for axis in (left, right):
        axis.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{workers} workers of a {data['weights_bytes'] / 1e6:.0f} MB model: "
                 "weights = \"load\" against \"mmap\", and the runtime alone")
    save(fig, out)


def memory_section(data: dict | None, img: Path) -> list[str]:
    out = ["## Memory per worker: shared weights", ""]
    if data is None:
        return out + not_measured("python bench/memory.py --json docs/results/memory.json")
    memory_figure(data, img / "memory.png")
    workers, weights = data["workers"], data["weights_bytes"]
    totals = {name: sum(values) for name, values in data["pss_bytes"].items()}
    mb = 1e6
    out += [
        f"`bench/memory.py` writes an MLP of {data['width']} x {data['width']} (+ a small head) as "
        f"a {weights / mb:.0f} MB `.safetensors` file and starts the daemon three times, each with "
        f"{workers} workers of 1 thread: the tiny example MLP (what a worker costs with no weights "
        "to speak of: the interpreter, torch, the serving loop), the big model with `weights = "
        "\"load\"` (every worker reads its own copy), and with `weights = \"mmap\"` (every worker "
        "maps the file copy-on-write). It sums the workers' PSS from `/proc/PID/smaps_rollup` "
        "(shared pages divided among their sharers, so the sum counts each page once) once all "
        "are READY and warmed up, every weight touched. PSS does not depend on the load.", ""]
    out += provenance(data, "memory") + [""]
    rows = [[name, f"{totals[name] / mb:,.0f} MB", f"{totals[name] / workers / mb:,.0f} MB"]
            for name in data["pss_bytes"]]
    out += table(["run", "total PSS", "per worker"], rows) + [""]
    runtime = totals.get("runtime", 0)
    out += [
        f"Target for mmap: {workers} x the runtime per worker + 1.2 x the weights = "
        f"{data['target_bytes'] / mb:,.0f} MB; measured {totals['mmap'] / mb:,.0f} MB: "
        f"{verdict(data['met'])}. The mapped weights add {(totals['mmap'] - runtime) / mb:,.0f} MB "
        f"to the runtime's PSS in all, against {(totals['load'] - runtime) / mb:,.0f} MB when "
        f"every worker loads its own copy ({workers} x {weights / mb:.0f} MB of weights).", ""]
    return out


# -- payloads -----------------------------------------------------------------------------------


PAYLOAD_PATHS = {
    "mw-shm-fresh": "modelwarden, shared memory, an ordinary tensor",
    "mw-shm-zero": "modelwarden, shared memory, `client.empty()`",
    "mw-inline": "modelwarden, inline frames",
    "mw-local": "modelwarden over `unix://` (the link's framing, not ZMTP)",
    "zmq-reqrep": "bare pyzmq REQ/REP",
    "zmq-proxy": "through a C `zmq.proxy` broker",
    "py-broker": "through the smallest Python broker (parses nothing)",
    "tmp-fresh": "torch.multiprocessing, a fresh tensor",
    "tmp-shared": "torch.multiprocessing, already shared",
    "procpool": "ProcessPoolExecutor (pickle)",
    "memcpy": "one memcpy",
    "copy-threads": "one torch copy on all threads",
    "in-process": "the model called in-process",
}


def us(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} us" if value < 1000 else f"{value / 1000:,.2f} ms"


def payloads_figure(data: dict, out: Path) -> None:
    sizes = list(data["sizes"])
    paths = [p for p in PAYLOAD_PATHS if p in data["results"]]
    fig, axes = plt.subplots(1, len(sizes), figsize=(13, 4.8), sharey=True)
    for axis, size in zip(axes, sizes):
        values = [data["results"][p].get(size, {}).get("p50_us") for p in paths]
        colours = ["tab:blue" if p.startswith("mw-") else "tab:gray" for p in paths]
        axis.barh(range(len(paths)), [v or 0 for v in values], color=colours)
        axis.set_xscale("log")
        axis.set_title(size)
        axis.set_xlabel("p50 round trip (us)")
        axis.grid(True, axis="x", which="both", alpha=0.3)
    axes[0].set_yticks(range(len(paths)), [PAYLOAD_PATHS[p].replace("`", "") for p in paths], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("An identity model's round trip by payload size, one client, sequential (blue: modelwarden)")
    save(fig, out)


def payloads_section(data: dict | None, img: Path) -> list[str]:
    out = ["## Moving tensors: payload transport", ""]
    if data is None:
        return out + not_measured("python bench/payloads.py --json docs/results/payloads.json")
    payloads_figure(data, img / "payloads.png")
    sizes = list(data["sizes"])
    out += [
        "`bench/payloads.py` round-trips an identity model (`forward(x) = x`) with payloads of "
        f"{', '.join(sizes)} through modelwarden (shared memory with ordinary tensors, shared memory "
        "with `client.empty()` buffers, inline frames; 1 worker, 1 thread) and through the "
        "alternatives, one client sending one request at a time, all in the same run. Each cell is "
        "the p50 of "
        f"{', '.join(f'{n} ({s})' for s, n in data['iterations'].items())} round trips.", ""]
    out += provenance(data, "payloads") + [""]
    rows = []
    for path, title in PAYLOAD_PATHS.items():
        if path in data["results"]:
            rows.append([title] + [us(data["results"][path].get(size, {}).get("p50_us")) for size in sizes])
    out += table(["path"] + sizes, rows) + [""]
    out += table(["target", "bound", "measured", ""],
                 [[t["target"], f"{t['op']} {t['bound']:g}", times(t["ratio"]), verdict(t["met"])]
                  for t in data["targets"]]) + [""]
    out += ["The fresh path costs one copy into a reused, pre-faulted shared buffer and returns the "
            "answer as a view of that buffer; the zero-copy path costs a round trip, whatever the "
            "size."]
    cpu = data["results"].get("cpu-per-request")
    proxy = data["results"].get("zmq-proxy", {}).get(sizes[0], {}).get("p50_us")
    broker = data["results"].get("py-broker", {}).get(sizes[0], {}).get("p50_us")
    missed = [t for t in data["targets"] if t["met"] is False]
    if cpu and missed:
        out += ["", f"Where the {sizes[0]} time goes: per round trip ({cpu['wall_us']} us of wall time) "
                f"the client spends {cpu['client_us']} us of CPU, the supervisor "
                f"{cpu['supervisor_us']} us and the worker {cpu['worker_us']} us, all threads "
                "included. A bare REQ client and REP worker only send and receive; ours turn "
                "tensors into descriptors and back, and the supervisor parses and checks every "
                "header (schema, dtype x shape, frame lengths, declared inputs, buffer tokens, byte "
                "budgets), keeps a deadline per request and picks a worker."
                + (f" The smallest Python broker, which parses nothing, already takes "
                   f"{times(ratio(broker, proxy))} the C proxy's round trip here, so a 1.2x budget "
                   "leaves no room for that work in Python objects: the request path is compiled "
                   "(docs/ARCHITECTURE.md, \"The compiled request path\"), but still makes and "
                   "reads Python objects per request; closing the gap needs a path that makes "
                   "none, or small requests batched."
                   if proxy and broker else "")]
    return out + [""]


# -- instructions per request (the compiled request path) -----------------------------------


INSTRUCTION_ROWS = {
    "floor": "the floor: a C `zmq.proxy` (ROUTER -> DEALER, REQ clients, REP echoes, 1 KiB, 8 in flight)",
    "supervisor batching off, compiled": "supervisor, batching off, compiled",
    "supervisor batching off, against": "supervisor, batching off, the checkout before the change",
    "supervisor batching off, uncompiled": "supervisor, batching off, uncompiled",
    "supervisor batching on, compiled": "supervisor, batching on (16, no delay), compiled",
    "supervisor batching on, against": "supervisor, batching on, the checkout before the change",
    "supervisor batching on, uncompiled": "supervisor, batching on, uncompiled",
    "supervisor batching off, compiled, unix": "supervisor, batching off, compiled, the client over unix://",
    "supervisor batching on, compiled, unix": "supervisor, batching on, compiled, the client over unix://",
    "client, compiled": "client, one 1 KiB round trip, compiled",
    "client, against": "client, one 1 KiB round trip, the checkout before the change",
    "client, uncompiled": "client, one 1 KiB round trip, uncompiled",
    "client, compiled, unix": "client, one 1 KiB round trip, compiled, over unix://",
    "worker, compiled": "worker, one 1 KiB round trip, compiled",
    "worker, against": "worker, one 1 KiB round trip, the checkout before the change",
    "worker, uncompiled": "worker, one 1 KiB round trip, uncompiled",
}


def instructions_section(data: dict | None) -> list[str]:
    out = ["## Instructions per request: the compiled request path", ""]
    if data is None:
        return out + not_measured("python bench/instructions.py --against CHECKOUT "
                                  "--json docs/results/instructions.json")
    out += [
        "`bench/instructions.py` counts instructions under callgrind, which this noisy machine "
        "cannot spoil: the same binary on the same input counts the same, whatever else runs. "
        "Every thread of the measured process is counted (libzmq's I/O thread too), not the "
        "kernel's work in system calls. The supervisor rows serve W1 (MLP 64 -> 256 -> 10, "
        f"[1, 64]) at {data['in_flight']} in flight to two workers, {data['requests']:,} requests "
        "after a warm-up, the client connected before the count; the client rows are one "
        "process's sequential 1 KiB round trips to an identity model, and the worker rows the "
        "same round trips counted in the model's one worker. \"the checkout before the "
        "change\" is the commit before this work (`acfd321`: `git worktree add /tmp/base acfd321`, "
        "then `python setup.py build_ext --inplace` there), built the same way and measured in "
        "the same run; \"uncompiled\" is this checkout without its compiled modules. The clients "
        "are on the daemon's `ipc://` frontend, except in the rows that say `unix://`: this "
        "checkout's client on its local frontend (the default on the daemon's host); the "
        "worker's side is the same on both. Whether a process runs libzmq on `ipc://` is the "
        "checkout's: this one's client and supervisor speak ZMTP themselves.", ""]
    out += provenance(data) + [""]
    rows = data["rows"]
    floor_count = rows["floor"]
    table_rows = []
    for key, title in INSTRUCTION_ROWS.items():
        if key in rows:
            ratio_to_floor = f"{rows[key] / floor_count:.2f}" if key.startswith(("floor", "super")) else "-"
            table_rows.append([title, f"{rows[key]:,}", ratio_to_floor])
    out += table(["row", "instructions per request", "x the floor"], table_rows) + [""]
    out += table(["target", "bound", "measured", ""],
                 [[t["target"], f"{t['op']} {t['bound']:g}", f"{t['value']:.2f}", verdict(t["met"])]
                  for t in data["targets"]]) + [""]
    return out


# -- CPU per 1 KiB round trip against the checkout before the change (payloads --cpu-against) --

def round_trip_cpu_section(data: dict | None) -> list[str]:
    out = ["## CPU per 1 KiB round trip: against the checkout before the change", ""]
    if data is None:
        return out + not_measured("python bench/payloads.py --cpu-against CHECKOUT "
                                  "--json docs/results/cpu_round_trip.json")
    other = ("a copy of this checkout without its compiled modules" if data["other"] == "uncompiled"
             else f"`{data['other']}` (the commit before the compiled request path, `acfd321`, "
                  "built in place)")
    out += [
        "`bench/payloads.py --cpu-against` measures the CPU time (user + system, every thread) "
        "that a client, the supervisor and the worker each spend per sequential 1 KiB round "
        f"trip to an identity model, in this checkout and in another, side by side, in turns: "
        f"here {other}, whose own bench/payloads.py measures its own daemon, worker and "
        "client over `ipc://`. This checkout is measured over `ipc://` and over its local "
        "frontend, `unix://`. A process's CPU is read in clock ticks, so a turn's ratio moves by "
        "several percent; the targets read the medians of the turns' own ratios.", ""]
    out += provenance(data) + [""]
    rows = []
    for turn in data["turns"]:
        for over, ratios in turn["ratios"].items():
            mine = turn["this"] if over == "ipc" else turn["this"]["unix"]
            rows.append([str(turn["turn"]), f"{over}://",
                         *(f"{mine[part]:.1f} / {turn['other'][part]:.1f} ({ratios[part]:.2f}x)"
                           for part in ("client_us", "supervisor_us", "worker_us", "wall_us"))])
    out += table(["turn", "this checkout over", "client µs (this / before)", "supervisor µs",
                  "worker µs", "wall µs"], rows) + [""]
    out += table(["target", "bound", "measured", ""],
                 [[t["target"], f"{t['op']} {t['bound']:g}", f"{t['value']:.2f}", verdict(t["met"])]
                  for t in data["targets"]]) + [""]
    return out


# -- the supervisor's ceiling (CPU per request against a C proxy's, alternating rounds) ---------

def ceiling_section(data: dict | None) -> list[str]:
    out = ["## CPU per request: what one supervisor core routes", ""]
    if data is None:
        return out + not_measured("python bench/ceiling.py --against CHECKOUT "
                                  "--json docs/results/ceiling.json")
    trees = data["trees"]
    out += [
        "`bench/ceiling.py` measures the supervisor's CPU time per request (user + system, every "
        f"thread) serving W1 at {data['in_flight']} in flight to two workers, batching off and "
        "on (16, no delay), and in the same round a C `zmq.proxy` broker's CPU per 1 KiB "
        "request at 8 in flight (ROUTER -> DEALER, REQ clients, REP echoes), over "
        f"{len(data['rounds'])} rounds in turns"
        + (", each round measuring a copy of this checkout without its compiled modules (the "
           "daemon, its workers and the load generator's client on the uncompiled path) right "
           "after this checkout"
           if data.get("against_uncompiled") else
           f", each round measuring commit `{data.get('commits', {}).get('against', '?')}` "
           "(the commit before a change, compiled in place) right after this checkout"
           if "against" in trees else "")
        + ". A round's ratio is to its own floor; the medians are stated. Requests/s is what one "
          "core routes at the median CPU (1e6 / µs). The clients are on the daemon's `ipc://` "
          "frontend (ZeroMQ's wire), and, in the rows that say so, this checkout's on its "
          "`unix://` frontend (the one a client on the daemon's host takes by default). The "
          "supervisor's loop reads and writes both itself, and so does this checkout's client "
          "(no libzmq I/O thread on either side: docs/ARCHITECTURE.md, \"The `ipc://` frontend "
          "speaks ZeroMQ without libzmq\").", ""]
    out += provenance(data) + [""]
    summary = data["summary"]
    rows = []
    keys = [(name, config) for name in trees for config in ("off", "on")]
    keys += [("this", f"{config} unix") for config in ("off", "on") if f"this {config} unix" in summary]
    for name, config in keys:
        row = summary[f"{name} {config}"]
        who = ("this checkout" if name == "this" else "the uncompiled path"
               if data.get("against_uncompiled") else "the checkout before the change")
        config = config.replace(" unix", ", clients over unix://")
        rows.append([f"{who}, batching {config}", ", ".join(f"{v:g}" for v in row["cpu_us"]),
                     f"{row['median_us']:g}", ", ".join(f"{v:.2f}" for v in row["ratios"]),
                     f"{row['median_ratio']:.2f}", f"{row['requests_per_s']:,}",
                     f"{row['median_served']:,.0f}",
                     f"{row['median_client_us']:g} / {row['median_workers_us']:g}"])
    out += table(["supervisor", "µs per request, by round", "median µs", "x the floor, by round",
                  "median x", "requests/s one core routes", "requests/s served (median)",
                  "client / workers µs per request (median)"], rows) + [""]
    floors = ", ".join(f"{row['floor']:g}" for row in data["rounds"])
    out += [f"The floor, by round: {floors} µs per request (median {summary['floor_us']:g}).", ""]
    out += table(["target", "bound", "measured", ""],
                 [[t["target"], f"{t['op']} {t['bound']:,}" if t["bound"] is not None else "-",
                   f"{t['value']:,}", verdict(t["met"]) if t["bound"] is not None else "-"]
                  for t in data["targets"]]) + [""]
    return out


# -- text (W4) ---------------------------------------------------------------------------------

TEXT_SYSTEMS = {"modelwarden": "modelwarden native", "gateway": "modelwarden gateway REST JSON",
                "clienttok": "client-side tokenizing (minilm.toml)", "mosec": "mosec",
                "litserve": "LitServe", "pytriton": "PyTriton"}


def text_series(data: dict) -> list[tuple[str, list[dict]]]:
    found: dict[str, list[dict]] = {}
    for p in data["points"]:
        if p.get("rps"):
            name = TEXT_SYSTEMS.get(p["system"], p["system"])
            if p["system"] in ("modelwarden", "gateway"):
                name += f", {p['config']}"
            found.setdefault(name, []).append(p)
    return [(name, sorted(rows, key=lambda p: p["concurrency"])) for name, rows in found.items()]


def text_figure(data: dict, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, rows in text_series(data):
        system = rows[0]["system"]
        colour = COLOURS.get(system, {"gateway": "tab:cyan", "clienttok": "tab:brown"}.get(system, "black"))
        style = dict(color=colour, marker="o", markersize=4, label=name,
                     linestyle="--" if "buckets off" in name else "-")
        x = [p["concurrency"] for p in rows]
        left.plot(x, [p["rps"] for p in rows], **style)
        right.plot(x, [p["p99_ms"] for p in rows], **style)
    for axis, title in ((left, "sentences/s (higher is better)"), (right, "p99 ms (lower is better)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("requests in flight (one text each)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=7)
    fig.suptitle("W4 text: all-MiniLM-L6-v2 + 2-class head, texts of 4-128 tokens, 2 workers x 1 thread")
    save(fig, out)


def text_section(data: dict | None, img: Path) -> list[str]:
    out = ["## Text: the background article's BERT service (W4)", ""]
    if data is None:
        return out + not_measured("python bench/text.py --json docs/results/text.json")
    workload = data["workload"]
    costs = workload.get("costs", {})
    out += [
        "`examples/textclassifier.toml` (docs/HANDLERS.md): texts in, logits out, the tokenizer in "
        "the worker's handler, batches of up to 16 per length bucket (16/32/64/128 tokens, 2 ms "
        f"wait). {workload['texts']} seeded texts of {min(workload['lengths'])}-"
        f"{max(workload['lengths'])} tokens, skewed short (per bucket "
        f"{', '.join(f'{k}: {v:.0%}' for k, v in costs.get('bucket_shares', {}).items())}), one "
        "text per request, closed loop. Buckets off pads every text to 128 tokens. The peers serve "
        "the same weights, head and tokenizer through their own handler APIs with their batching "
        "on (16, 2 ms), each in its own virtualenv.", ""]
    text_figure(data, img / "text.png")
    out += provenance(data, "text") + [""]
    rows = []
    for name, series_rows in text_series(data):
        for p in series_rows:
            rows.append([name, str(p["concurrency"]), rps(p["rps"]), ms(p["p50_ms"]),
                         ms(p["p99_ms"]), str(p["errors"]),
                         "-" if p.get("mean_batch") is None else f"{p['mean_batch']:.1f}"])
    out += table(["system", "in flight", "sentences/s", "p50", "p99", "errors", "mean batch"],
                 rows) + [""]
    out += ["Where the difference comes from: the peers batch whatever arrives and pad each batch to "
            "its longest text, so one long text makes its 15 batch mates pay for its length; with "
            "buckets a batch holds texts of one bucket, padded to its longest member, and buckets off "
            "pays 128 tokens for every text. The client-side tokenizing example batches by the same "
            "buckets (the client pads each text to its bucket's edge): tokenising in the worker costs "
            "about what it costs in the client, once per text.", ""]
    out += ["The issue's targets, as ratios within this run:", ""]
    out += table(["target", "measured", "bound", "verdict", "where the time goes"],
                 [[t["target"], "-" if t["value"] is None else f"{t['value']:g}",
                   f"{t['op']} {t['bound']:g}", verdict(t["met"]), t["how"]]
                  for t in data["targets"]]) + [""]
    return out


# -- soak ---------------------------------------------------------------------------------------


def soak_section(data: dict | None) -> list[str]:
    out = ["## Soak: load while workers are SIGKILLed", ""]
    if data is None:
        return out + not_measured("python bench/soak.py --minutes 2 --json docs/results/soak.json")
    out += [
        f"`bench/soak.py` runs {data.get('clients', 4)} clients (small inline and big shared-memory "
        f"requests) against {data.get('workers', 2)} workers while a random READY worker is "
        f"SIGKILLed every {data.get('kill_every_s', 0.3):g} s. Its contract: every request is "
        "answered (sent = ok + typed errors), none wrongly, no shared memory left held, and the "
        "only failures are POISON: requests that were in flight on both workers they were tried on, "
        "as the retry rule says (so at most one per two kills).", ""]
    out += provenance(data) + [""]
    failed = sum(data["errors"].values())
    poison = data["errors"].get("POISON", 0)
    kept = (data["sent"] == data["ok"] + failed and data["wrong"] == 0 and not data["unexpected"]
            and set(data["errors"]) <= {"POISON"} and 2 * poison <= data["kills"]
            and data["leaked_buffer_holders"] == 0)
    out += table(["minutes", "SIGKILLs", "sent", "answered right", "wrong", "typed errors",
                  "processes still holding a buffer", "contract"],
                 [[f"{data['minutes']:g}", str(data["kills"]), f"{data['sent']:,}", f"{data['ok']:,}",
                   str(data["wrong"]), ", ".join(f"{k} {v}" for k, v in data["errors"].items()) or "none",
                   str(data["leaked_buffer_holders"]), "kept" if kept else "**broken**"]]) + [""]
    return out


# -- the benchmarks that print only -------------------------------------------------------------


OTHERS = [
    "## Benchmarks this report does not draw", "",
    "These print their results and write no JSON here; run them to measure:", "",
    "* `python bench/client_profile.py [--warm S]`: the client's share of a round trip (identity "
    "model, 2 workers x 1 thread): 1 KiB one at a time and at 64 in flight, 4 MiB over shared "
    "memory at 8 and 64 in flight through `submit`, `AsyncClient` and 64 threads; per point "
    "requests/s, p50, p99 and the CPU per request of the client and of the supervisor. At 4 MiB "
    "the client's cost is its one copy into shared memory, made on the calling thread: torch's "
    "threaded `copy_` waits for its slowest intra-op thread, which on cores busy with the daemon "
    "costs far more than the copy. A cold concurrent point grows the client's arena (one 4 MiB "
    "buffer per request in flight, each pre-faulted), which is what a short run without "
    "`--warm` mostly measures.",
    "* `python bench/minilm.py`: all-MiniLM-L6-v2 served by `examples/minilm.toml` (2 workers, "
    "batching up to 16, 32 tokens per sentence): latency at 1 in flight, sentences/s at 64 in "
    "flight with the mean batch the daemon formed, and the same model in-process for scale.",
    "* `python bench/status_latency.py`: the wall time and CPU of one `modelwarden status` in a "
    "fresh process, against a 150 ms target (the command imports neither torch, numpy nor "
    "pydantic).",
    "* `python bench/gpu_check.py`: the CUDA paths on a GPU machine, one PASS/FAIL/SKIP line per "
    "check (devices, streams, page-locked client buffers, CUDA OOM, `max_cuda_memory`, CUDA "
    "memory in `status` and `/metrics`, requests/s of 1 against N workers on one GPU). Without a "
    "CUDA device every check prints SKIP; the machine above has none.",
    "* `make mutants` (`bench/mutants.py`): each targeted mutation of the code must make the "
    "tests that claim to guard it fail.", "",
]


# -- the document -------------------------------------------------------------------------------


HEADER = [
    "# Benchmarks", "",
    "<!-- generated by bench/report.py from the JSON in docs/results/: do not edit. Edit the "
    "prose in bench/report.py, or measure again (make report-data) and run make report. -->", "",
    "Generated by `python bench/report.py` from the JSON in `docs/results/` that each benchmark "
    "wrote; do not edit by hand. `make report` redraws this page and its figures (`docs/img/`) "
    "from that JSON; `make report-data` runs the benchmarks again first.", "",
    "## Reading these numbers", "",
    "Every figure states the command that made it and the machine it ran on. The development "
    "machine has 2 cores shared with other work (the load average when a run began is in its "
    "caption), so absolute numbers move from run to run and from day to day; the comparisons "
    "here are ratios of numbers measured within one run, which move far less. The load "
    "generators run on the same cores as the servers they measure.", "",
]


def render(results: Path, img: Path) -> str:
    img.mkdir(parents=True, exist_ok=True)
    serving = load(results, "serving")
    lines = list(HEADER)
    lines += serving_section(serving, img)
    lines += gateway_section(serving, img)
    lines += recovery_section(load(results, "recovery"), img)
    lines += memory_section(load(results, "memory"), img)
    lines += payloads_section(load(results, "payloads"), img)
    lines += instructions_section(load(results, "instructions"))
    lines += round_trip_cpu_section(load(results, "cpu_round_trip"))
    lines += ceiling_section(load(results, "ceiling"))
    lines += text_section(load(results, "text"), img)
    lines += soak_section(load(results, "soak"))
    lines += OTHERS
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results",
                        help="the benchmarks' JSON (default: the committed docs/results)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    args.doc.write_text(render(args.results, args.img))
    print(f"wrote {args.doc} and its figures in {args.img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
