"""The text peers of bench/text.py (W4): mosec, LitServe and PyTriton serving the example's model,
head and tokenizer (bench/peers/text_NAME_server.py, in bench/serving.py's peer virtualenvs plus
tokenizers), started, waited for and loaded (bench/peers/textload.py) from this process.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from bench.serving import PEERS, ROOT, Timing, free_port, peer_python, stop_peer, wait_answering

# name -> (inference route, body format of bench/peers/textload.py)
TEXT_PEERS = {"mosec": ("/inference", "json"), "litserve": ("/predict", "json"),
              "pytriton": ("/v2/models/text/infer", "triton")}
PEER_EXTRA = ("tokenizers==0.23.3",)  # the tokenizer the example's handler uses
BATCH, WAIT_MS = 16, 2  # the example's max_size and max_delay_us


def write_peer_files(workdir: Path, handler, texts: list[str], expected: list, atol: float
                     ) -> tuple[Path, Path]:
    """The spec a text peer loads (the example's weights, head and tokenizer, from the loaded
    ``handler``) and its load (the texts, the logits expected for each, the tolerance)."""
    from modelwarden.minilm import TOKENIZER_FILE, package_file

    state, prototypes = workdir / "minilm.state.pt", workdir / "prototypes.pt"
    # cloned: the mmap-ed weights share storages, which torch.save refuses
    torch.save({key: value.clone() for key, value in handler.model.state_dict().items()}, state)
    torch.save(handler.prototypes.clone(), prototypes)
    spec = workdir / "text.spec.json"
    spec.write_text(json.dumps({"minilm": str(ROOT / "modelwarden" / "minilm.py"), "state": str(state),
                                "prototypes": str(prototypes), "scale": handler.scale,
                                "tokenizer": str(package_file(TOKENIZER_FILE))}))
    data = workdir / "text.inputs.json"
    data.write_text(json.dumps({"texts": texts, "atol": atol,
                                "expected": [row.tolist() for row in expected]}))
    return spec, data


def start_text_peer(name: str, workdir: Path, spec: Path, data: Path, timeout: float = 240.0):
    port = free_port()
    route, fmt = TEXT_PEERS[name]
    env = {**os.environ, "BENCH_SPEC": str(spec), "BENCH_MAX_BATCH": str(BATCH),
           "BENCH_WAIT_MS": str(WAIT_MS), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "bench" / "peers")}
    log_path = workdir / f"text-{name}.log"
    process = subprocess.Popen([str(peer_python(PEERS[name])),
                                str(ROOT / "bench" / "peers" / f"text_{name}_server.py"),
                                "--port", str(port)], cwd=workdir, env=env,
                               stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}{route}"
    try:
        wait_peer(process, url, fmt, json.loads(data.read_text())["texts"][0], timeout, name)
    except RuntimeError as exc:
        stop_peer(process)
        raise RuntimeError(f"{exc}\n{log_path.read_text(errors='replace')[-1500:]}") from None
    return process, url, fmt


def wait_peer(process, url: str, fmt: str, text: str, timeout: float, name: str) -> None:
    """Until one real inference answers 200: health endpoints can answer before the workers."""
    if fmt == "triton":
        body = {"inputs": [{"name": "texts", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    else:
        body = {"texts": [text]}
    wait_answering(process, url, json.dumps(body).encode(), "application/json", timeout, name)


def text_peer_point(name: str, url: str, fmt: str, data: Path, concurrency: int,
                    timing: Timing) -> dict:
    done = subprocess.run([str(peer_python(PEERS[name])), str(ROOT / "bench" / "peers" / "textload.py"),
                           "--url", url, "--format", fmt, "--data", str(data),
                           "--concurrency", str(concurrency), "--warmup", str(timing.warmup_s),
                           "--duration", str(timing.duration_s)],
                          capture_output=True, text=True, timeout=timing.warmup_s + timing.duration_s + 180)
    if done.returncode != 0:
        return {"ok": 0, "errors": None, "rps": None, "p50_ms": None, "p99_ms": None,
                "first_error": "load generator failed: " + done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])
