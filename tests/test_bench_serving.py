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
    expected = [("modelwarden", config, 8) for config in configs]
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
    row = points[("modelwarden", "batching off", 8)]
    assert row["supervisor_cpu_us"] > 0
    assert 0 <= row["supervisor_sys_us"] <= row["supervisor_cpu_us"]  # the kernel's share of it
    assert "W1@64 batching on / batching off" in [t["target"] for t in result["targets"]]
