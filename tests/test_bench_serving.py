"""The serving benchmark still runs: bench/serving.py in a quick smoke configuration (no peers,
W1 only, 1 and 8 in flight) produces every point it promises, with answers and no errors (the
KServe gateway's points too, when its extras are installed, with perf_analyzer's where its
binary can run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_quick_serving_bench_measures_every_point(tmp_path):
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, "bench/serving.py", "--quick", "--no-peers",
                           "--workloads", "W1", "--concurrency", "8", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    points = {(p["system"], p["config"], p["concurrency"]) + ((p["transport"],) if p["system"] == "gateway"
                                                             else ()): p for p in result["points"]}
    batching = not any("batching on: skipped" in note for note in result["notes"])
    configs = ["batching off"] + (["batch 16, delay 0us", "batch 16, delay 1000us"] if batching else [])
    expected = [(system, config, 8) for config in configs
                for system in ("modelwarden", "modelwarden-local")]  # ZeroMQ; the local frontend
    expected += [("in-process", f"{scheme}, {os.cpu_count()} threads", 8)
                 for scheme in ("lock", "queue, 1 worker")]
    if not any(note.startswith("gateway: skipped") for note in result["notes"]):
        transports = ["REST JSON", "REST binary", "gRPC"]
        if not any(note.startswith("gateway: perf_analyzer") for note in result["notes"]):
            transports.append("gRPC perf_analyzer")
        expected += [("gateway", config, 8, transport)
                     for config in ("batching off", "batch 16, delay 1000us") for transport in transports]
        expected.append(("gateway", "batching off", 1, "gRPC empty call"))
        if "gRPC perf_analyzer" in transports and not any(
                note.startswith("gateway: gRPC C++ empty server skipped") for note in result["notes"]):
            expected.append(("gateway", "batching off", 1, "gRPC C++ empty server"))
    assert sorted(points) == sorted(expected)
    for key, row in points.items():
        assert row["ok"] > 0 and row["errors"] == 0, (key, row.get("first_error"), row)
        if key[-1] not in ("gRPC perf_analyzer", "gRPC C++ empty server"):  # perf_analyzer checks
            # nothing; a failure fails it
            assert row["checked"] > 0, (key, row)  # answers were compared with the in-process model
    for system, transport in (("modelwarden", "ZeroMQ ipc"), ("modelwarden-local", "unix (local frontend)")):
        row = points[(system, "batching off", 8)]
        assert row["transport"] == transport
        assert row["supervisor_cpu_us"] > 0
        assert 0 <= row["supervisor_sys_us"] <= row["supervisor_cpu_us"]  # the kernel's share of it
    assert "W1@64 batching on / batching off" in [t["target"] for t in result["targets"]]


def test_the_ceiling_takes_each_rounds_ratio_to_its_own_floor_and_the_medians():
    """bench/ceiling.py: a round's ratio is its CPU over the floor measured in that round (a
    slow round's floor is slow too), and the summary's are the medians of those."""
    from bench import ceiling

    rows = [{"round": 1, "this off": 60.0, "this on": 20.0, "floor": 20.0},
            {"round": 2, "this off": 90.0, "this on": 45.0, "floor": 40.0},
            {"round": 3, "this off": 66.0, "this on": 24.0, "floor": 30.0}]
    for row, served in zip(rows, (1000, 3000, 2000)):
        for config in ("off", "on"):
            row[f"this {config} served"] = served
            row[f"this {config} client"], row[f"this {config} workers"] = served / 100, 5.0
    summary = ceiling.summarise(rows, {"this": ROOT})
    off, on = summary["this off"], summary["this on"]
    assert off["ratios"] == [3.0, 2.25, 2.2] and off["median_ratio"] == 2.25
    assert off["median_us"] == 66.0 and off["requests_per_s"] == round(1e6 / 66.0)
    assert on["median_ratio"] == 1.0 and summary["floor_us"] == 30.0
    assert on["median_served"] == 2000 and on["median_client_us"] == 20.0
    assert on["median_workers_us"] == 5.0
    verdicts = {line["target"]: line["met"] for line in ceiling.targets(summary, rows, against=False)}
    assert [met for target, met in verdicts.items() if "batching off" in target] == [True, False]
    assert [met for target, met in verdicts.items() if "batching on" in target] == [True, False]


def test_the_ceiling_states_requests_served_against_the_other_build_round_by_round():
    """With --against, the served ratio is the median of each round's own ratio (a slow round
    slows both builds), and batching on must serve 1.5x the other build's (issue 24)."""
    from bench import ceiling

    rows = []
    for number, (this, other) in enumerate(((1600, 1000), (3200, 2000), (900, 1000)), 1):
        row = {"round": number, "floor": 20.0}
        for name, served in (("this", this), ("against", other)):
            for config in ("off", "on"):
                row[f"{name} {config}"], row[f"{name} {config} served"] = 30.0, served
                row[f"{name} {config} client"] = row[f"{name} {config} workers"] = 10.0
        rows.append(row)
    summary = ceiling.summarise(rows, {"this": ROOT, "against": ROOT})
    served = {line["target"]: line for line in ceiling.targets(summary, rows, against=True)
              if "requests/s served" in line["target"]}
    on = next(line for target, line in served.items() if "batching on" in target)
    off = next(line for target, line in served.items() if "batching off" in target)
    assert on["value"] == 1.6 and on["met"] is True and on["bound"] == 1.5
    assert off["value"] == 1.6 and off["met"] is None  # stated, not a target
    rows[1]["this on served"] = 2000  # 1.0 in that round: the median falls to 1.0
    summary = ceiling.summarise(rows, {"this": ROOT, "against": ROOT})
    on = next(line for line in ceiling.targets(summary, rows, against=True)
              if "requests/s served" in line["target"] and "batching on" in line["target"])
    assert on["value"] == 1.0 and on["met"] is False


@pytest.mark.slow
def test_a_quick_ceiling_round_measures_the_supervisor_and_the_floor(tmp_path):
    out = tmp_path / "ceiling.json"
    done = subprocess.run([sys.executable, "bench/ceiling.py", "--quick", "--rounds", "1",
                           "--against-uncompiled", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    (row,) = result["rounds"]
    assert row["this off"] > 0 and row["this on"] > 0 and row["floor"] > 0
    assert row["this off served"] > 0 and row["this on served"] > 0
    # the uncompiled copy, measured by a process of its own (which checks it ran uncompiled)
    assert row["against off"] > 0 and row["against on served"] > 0
    assert all(row[f"{name} {config} {part}"] > 0 for name in ("this", "against")
               for config in ("off", "on") for part in ("client", "workers"))
    assert result["against_uncompiled"] is True
    assert result["summary"]["this off"]["ratios"] == [round(row["this off"] / row["floor"], 3)]
    # this build's clients over unix:// too (the local frontend), in the same round
    assert row["this off unix"] > 0 and row["this on unix served"] > 0
    assert len(result["targets"]) == 14
    assert "requests/s one supervisor core routes, batching off, clients over unix://" in done.stdout
    assert "W1@64 requests/s served, this build / the other, batching on" in done.stdout
    assert "supervisor CPU / C proxy CPU at 8 in flight, batching off" in done.stdout


def test_the_instruction_counts_put_unix_rows_against_the_others_over_ipc():
    """bench/instructions.py: this checkout's client on the local frontend (rows ending ", unix")
    is compared with the uncompiled path's and the other checkout's rows over ipc://, the only
    frontend they have; the worker's rows have no unix:// twin."""
    from bench import instructions

    rows = {"floor": 10_000,
            "supervisor batching off, compiled": 30_000, "supervisor batching off, compiled, unix": 20_000,
            "supervisor batching off, uncompiled": 100_000,
            "client, compiled": 50_000, "client, compiled, unix": 30_000,
            "client, uncompiled": 100_000, "client, against": 80_000,
            "worker, compiled": 45_000, "worker, uncompiled": 100_000}
    report = {line["target"]: line for line in instructions.targets(rows)}
    assert report["supervisor W1@64, batching off, unix / C proxy floor"]["value"] == 2.0
    assert report["supervisor W1@64, batching off, unix / C proxy floor"]["met"] is True
    assert report["supervisor W1@64, batching off / C proxy floor"]["met"] is False  # 3.0
    assert report["supervisor W1@64, batching off: compiled, unix / uncompiled"]["value"] == 0.2
    assert report["client, 1 KiB round trip: compiled, unix / uncompiled"]["value"] == 0.3
    assert report["client, 1 KiB round trip: compiled, unix / against"]["value"] == 0.375
    assert report["client, 1 KiB round trip: compiled / against"]["met"] is False  # 0.625
    assert report["worker, 1 KiB round trip: compiled / uncompiled"]["met"] is False  # 0.45
    assert not [target for target in report if target.startswith("worker") and "unix" in target]


def test_the_round_trip_cpu_targets_take_the_median_of_each_turns_own_ratio():
    """bench/payloads.py --cpu-against: a turn's ratio is this checkout's CPU over the other's
    in that turn; the targets (client and worker <= 0.4x) read the medians, per transport."""
    from bench import payloads

    def turn(client, worker):
        parts = {"client_us": client, "supervisor_us": 0.5, "worker_us": worker, "wall_us": 0.5}
        return {"ratios": {"ipc": dict(parts), "unix": {**parts, "client_us": client / 2}}}

    rows = [turn(0.9, 0.3), turn(0.5, 0.45), turn(0.6, 0.2)]
    medians, report = payloads.cpu_targets(rows)
    assert medians["ipc"]["client_us"] == 0.6 and medians["unix"]["client_us"] == 0.3
    assert medians["ipc"]["worker_us"] == 0.3
    verdicts = {(line["target"].split()[0], "unix" in line["target"]): line["met"] for line in report}
    assert verdicts == {("client", False): False, ("worker", False): True,
                        ("client", True): True, ("worker", True): True}
