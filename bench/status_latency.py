"""What one ``modelwarden status`` costs an operator: wall time and CPU of the whole command.

    python bench/status_latency.py [--runs 20]

Starts one daemon (bench/payloads.py's identity model), then runs the installed command
``modelwarden status --config FILE`` ``--runs`` times in a fresh process each, as
``watch modelwarden status`` does. Prints the median and the worst wall time and CPU (user +
system, from the child's rusage) and checks the median wall time against issue 10's target,
150 ms; exits 1 when it is missed.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import payloads  # noqa: E402

TARGET_MS = 150.0


def one_status(command: list[str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one run; raises if the command fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(command, check=True, capture_output=True)
    wall = (time.monotonic() - start) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mw-status-"))
    daemon = payloads.start_daemon(workdir)
    try:
        command = [str(Path(sys.executable).with_name("modelwarden")), "status",
                   "--config", str(workdir / "bench.toml")]
        one_status(command)  # the page cache, not the command, pays for the first read
        runs = [one_status(command) for _ in range(args.runs)]
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    walls, cpus = [run[0] for run in runs], [run[1] for run in runs]
    median = statistics.median(walls)
    print(f"modelwarden status, {args.runs} runs: wall median {median:.0f} ms, worst {max(walls):.0f} ms;"
          f" CPU median {statistics.median(cpus):.0f} ms, worst {max(cpus):.0f} ms")
    verdict = "PASS" if median <= TARGET_MS else "MISS"
    print(f"target: median wall <= {TARGET_MS:.0f} ms: {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
