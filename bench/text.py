"""W4 "text": the article's BERT service (examples/textclassifier.toml) under closed-loop load,
against the same model and tokenizer in mosec, LitServe and PyTriton, in one run (issue 23).

    make bench-text                         # = .venv/bin/python bench/text.py
    python bench/text.py [--quick] [--only SYSTEMS] [--concurrency 1,16,64] [--no-peers]
                         [--json PATH]

Load: one text per request (so requests/s = sentences/s), drawn in turn from SAMPLE texts made
from a seeded word list at a seeded mix of lengths, 4 to 128 tokens, skewed short (MIX: half of
them 4-16 tokens, one in twenty 65-128). Closed loop at 1, 16 and 64 in flight; a warm-up, then a
fixed window (2 s + 8 s; --quick 1 s + 3 s: a batch of long texts takes a second on one
core). Every 25th answer of a caller is compared with the handler's logits computed in this
process (a mismatch is an error).

Systems (--only takes these names):
  modelwarden   the example as shipped (2 workers x 1 thread, batch 16, 2000 us, buckets 16/32/
                64/128), modelwarden.Client at 1 in flight, AsyncClient tasks above; "buckets
                off": the same with no buckets and every text padded to 128 tokens (the handler's
                pad_to, the article's first version). Also the first request after READY.
  gateway       the same daemons' KServe v2 REST gateway, JSON with a BYTES tensor (http.client,
                one keep-alive connection per thread); skipped without the gateway extra.
  clienttok     examples/minilm.toml, the client-side tokenizing example: the client tokenises
                each text (inside the timed call) and pads it to its bucket's edge, so the
                daemon's identical-shape batching joins texts of a bucket, as the server side
                does. Same load, same batching; embeddings out instead of logits (the head is a
                [384 x 2] product).
  mosec, litserve, pytriton
                peers in their own virtualenvs under bench/.peers/NAME (bench/serving.py's,
                plus tokenizers), servers bench/peers/text_NAME_server.py: 2 workers x 1 thread,
                their batching on (max 16, wait 2 ms), each batch tokenised together and padded
                to its longest text; load by bench/peers/textload.py in the peer's virtualenv.

After the table, the issue's targets as ratios of numbers measured in this run, PASS/MISS, each
miss with where the time goes. Everything is also written as JSON (default bench/results/text.json).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Window, run_async, run_threads  # noqa: E402
from bench.machine import command, machine  # noqa: E402
from bench.serving import (PEERS, Timing, check, free_port, install_peer, point,  # noqa: E402
                           ratio, stop_peer, stop_process, write_results)
from bench.textpeers import (PEER_EXTRA, TEXT_PEERS, start_text_peer, text_peer_point,  # noqa: E402
                             write_peer_files)

SYSTEMS = ("modelwarden", "gateway", "clienttok", "mosec", "litserve", "pytriton")
EXAMPLE = ROOT / "examples" / "textclassifier.toml"
CLIENT_EXAMPLE = ROOT / "examples" / "minilm.toml"
MODEL, WORKLOAD = "textclassifier", SimpleNamespace(name="W4")
SEED, SAMPLE, BATCH = 23, 96, 16
ATOL = 1e-3  # logits of ~5: padding in a batch moves them by ~1e-6
# (shortest, longest tokens, share): real traffic is mostly short
MIX = ((4, 16, 0.50), (17, 32, 0.30), (33, 64, 0.15), (65, 128, 0.05))
WORDS = ("the a service was good bad great slow fast room food staff price quality movie film "
         "story phone screen battery camera delivery order shop hotel night day week time "
         "people friend family music show game book review product support team manager "
         "happy sad angry late early clean dirty cheap expensive new old small large loud quiet "
         "and but so because then when very really quite never always again still just also "
         "we i you they it this that our their my your is are had have did not would could "
         "will can must should work works worked broke arrived came left stayed ate bought paid "
         "loved hated liked enjoyed recommend return refund call help wait waited answer "
         "in on at with for of to from about after before during without over under").split()


# -- the load --------------------------------------------------------------------------------


def wordpiece():
    """The example's tokenizer (no padding, cut at 128), as the handler sets it up."""
    from tokenizers import Tokenizer

    from modelwarden.minilm import TOKENIZER_FILE, package_file

    tokenizer = Tokenizer.from_file(str(package_file(TOKENIZER_FILE)))
    tokenizer.enable_truncation(max_length=128)
    tokenizer.no_padding()
    return tokenizer


def make_texts(tokenizer, seed: int = SEED, count: int = SAMPLE) -> list[str]:
    """``count`` texts whose token counts ([CLS] and [SEP] included) follow MIX: seeded words,
    cut at the character where the wanted token count ends."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        low, high, _ = rng.choices(MIX, weights=[share for *_, share in MIX])[0]
        wanted = rng.randint(low, high)
        words = " ".join(rng.choice(WORDS) for _ in range(wanted + 8))
        offsets = tokenizer.encode(words).offsets  # [CLS] and [SEP] are (0, 0)
        texts.append(words[:offsets[wanted - 2][1]])
    return texts


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


def bucket_edge(length: int, edges=(16, 32, 64, 128)) -> int:
    return next((edge for edge in edges if length <= edge), edges[-1])


@dataclass
class Corpus:
    """The texts, what the example answers for each, and in-process costs for the targets."""

    texts: list[str]
    lengths: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    embeddings: list[torch.Tensor] = field(default_factory=list)
    costs: dict = field(default_factory=dict)


def make_corpus(quick: bool) -> tuple[Corpus, object]:
    from modelwarden.textclassifier import classify, load_in_process

    torch.set_num_threads(1)
    tokenizer = wordpiece()
    texts = make_texts(tokenizer)
    corpus = Corpus(texts, token_counts(tokenizer, texts))
    handler = load_in_process()
    with torch.inference_mode():
        for text in texts:
            corpus.logits.append(classify(handler, [text])[0].clone())
            corpus.embeddings.append(handler.model(**handler.preprocess([text]))[0].clone())
    corpus.costs = measure_costs(handler, corpus, tokenizer, 1 if quick else 3)
    return corpus, handler


def _median_ms(call, repeats: int) -> float:
    call()  # the first call of a shape pays its allocations
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1000, 2)


def measure_costs(handler, corpus: Corpus, tokenizer, repeats: int) -> dict:
    """In-process, 1 thread: one batch-16 forward of 16 texts at each bucket's edge (and their
    mean weighted by the mix: the SLA's 'one batch-16 forward'), of 16 texts of the mix padded
    to the longest of them (no buckets), and tokenising one text."""
    rng = random.Random(SEED + 1)
    draws = [rng.sample(corpus.texts, BATCH) for _ in range(repeats)]

    def mix_forward():
        with torch.inference_mode():
            for texts in draws:
                handler.forward(handler.preprocess(texts))

    costs = {"batch16_mix_ms": round(_median_ms(mix_forward, 1) / len(draws), 2)}
    for edge in (16, 32, 64, 128):
        batch = {"input_ids": torch.full((BATCH, edge), 1000), "attention_mask": torch.ones(BATCH, edge,
                                                                                           dtype=torch.int64)}
        with torch.inference_mode():
            costs[f"batch16_at_{edge}_ms"] = _median_ms(lambda b=batch: handler.forward(b), repeats)
    started = time.perf_counter()
    for text in corpus.texts:
        tokenizer.encode(text)
    costs["tokenize_one_us"] = round((time.perf_counter() - started) / len(corpus.texts) * 1e6, 1)
    shares = {edge: sum(bucket_edge(n) == edge for n in corpus.lengths) / len(corpus.lengths)
              for edge in (16, 32, 64, 128)}
    costs["bucket_shares"] = {str(edge): round(share, 3) for edge, share in shares.items()}
    # the mean cost of one batch of 16 under buckets: the SLA's "one batch-16 forward"
    costs["batch16_bucketed_ms"] = round(sum(share * costs[f"batch16_at_{edge}_ms"]
                                             for edge, share in shares.items()), 2)
    costs["mean_tokens"] = round(statistics.mean(corpus.lengths), 1)
    return costs


def logits_match(corpus: Corpus, index: int, output) -> bool:
    logits = output["logits"] if isinstance(output, dict) else output
    return torch.allclose(torch.as_tensor(logits).reshape(-1)[:2], corpus.logits[index], atol=ATOL)


# -- daemons ---------------------------------------------------------------------------------


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"


def render(daemon: dict, model: dict, gateway: dict | None) -> str:
    """A config file: [daemon], one [[models]] (its sub-tables after its keys), [gateway]."""
    lines = ["[daemon]"] + [f"{key} = {toml_value(value)}" for key, value in daemon.items()]
    lines += ["", "[[models]]"]
    tables = {key: value for key, value in model.items() if key in ("batching", "probe")}
    lines += [f"{key} = {toml_value(value)}" for key, value in model.items() if key not in tables]
    for key, table in tables.items():
        lines += [f"[models.{key}]"] + [f"{name} = {toml_value(value)}" for name, value in table.items()]
    if gateway:
        lines += ["", "[gateway]"] + [f"{key} = {toml_value(value)}" for key, value in gateway.items()]
    return "\n".join(lines) + "\n"


def example_model(path: Path, buckets: bool = True) -> dict:
    """The example's model table as shipped, its probe files absolute; ``buckets=False``: no
    buckets, every text padded to the last bucket (128) by the handler instead."""
    model = tomllib.loads(path.read_text())["models"][0]
    model["max_queue"] = 4096  # 64 in flight must never be OVERLOADED
    probe = model.get("probe", {})
    for key in ("input", "golden"):
        if key in probe:
            probe[key] = str(path.parent / probe[key])
    if not buckets:
        batching = model["batching"]
        last = batching["buckets"][-1]
        for key in ("buckets", "length_dim", "pad", "mask", "too_long", "bytes_per_token"):
            batching.pop(key, None)
        model["kwargs"] = {**model.get("kwargs", {}), "pad_to": last}
    return model


@dataclass
class Daemon:
    process: subprocess.Popen
    runtime: Path
    model: str
    http: str | None

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.runtime}/frontend.sock"


def daemon_settings(runtime: Path) -> dict:
    return {"runtime_dir": str(runtime), "log_level": "WARNING", "allow_oversubscription": True}


def start_daemon(workdir: Path, label: str, model: dict, gateway: bool) -> Daemon:
    """The daemon on ``model``; returns once every worker is READY (no request sent: the first
    request after READY is measured)."""
    slug = label.replace(" ", "_")
    runtime = workdir / slug
    http = f"127.0.0.1:{free_port()}" if gateway else None
    config = workdir / f"{slug}.toml"
    config.write_text(render(daemon_settings(runtime), model, {"http": http} if http else None))
    log = open(workdir / f"{slug}.log", "wb")
    env = {key: value for key, value in os.environ.items() if not key.startswith("MODELWARDEN_")}
    process = subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config", str(config)],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(process, runtime, model["name"], http)
    try:
        wait_ready(daemon, model["workers"], 300)
        if http:
            wait_gateway(daemon, 120)
    except RuntimeError as exc:
        stop_process(process)
        tail = (workdir / f"{slug}.log").read_text(errors="replace")[-2500:]
        raise RuntimeError(f"{exc}\n{tail}") from None
    return daemon


def status(daemon: Daemon) -> dict:
    from modelwarden.client.control import control_request

    return control_request(f"ipc://{daemon.runtime}/control.sock", {"type": "status"}, 5.0)["status"]


def wait_ready(daemon: Daemon, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and daemon.process.poll() is None:
        try:
            if status(daemon)["models"][0]["ready"] == workers:
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.2)  # a benchmark waiting for a daemon, not a test synchronising
    raise RuntimeError(f"the daemon did not get {workers} workers of {daemon.model} READY")


def wait_gateway(daemon: Daemon, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and daemon.process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{daemon.http}/v2/health/ready", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


def batch_counts(daemon: Daemon) -> tuple[int, float]:
    """(batches formed, requests in them) so far."""
    batching = status(daemon)["models"][0].get("batching") or {}
    batches = batching.get("batches", 0)
    return batches, batches * (batching.get("mean_size") or 0.0)


def native_point(daemon: Daemon, request, check, concurrency: int, timing: Timing) -> dict:
    """modelwarden.Client at 1 in flight, one AsyncClient with ``concurrency`` tasks above;
    ``request(index)`` is the inputs of request ``index`` (called inside the timed call)."""
    from modelwarden import AsyncClient, Client

    window = Window(timing.warmup_s, timing.duration_s)
    before = batch_counts(daemon)
    if concurrency == 1:
        with Client(daemon.endpoint, timeout=60) as client:
            result = run_threads(lambda i: client.infer(daemon.model, request(i)), 1, window,
                                 SAMPLE, check)
    else:
        async def load() -> dict:
            async with AsyncClient(daemon.endpoint, timeout=60) as client:
                return await run_async(lambda i: client.infer(daemon.model, request(i)),
                                       concurrency, window, SAMPLE, check)

        result = asyncio.run(load())
    after = batch_counts(daemon)
    formed = after[0] - before[0]
    result["mean_batch"] = round((after[1] - before[1]) / formed, 1) if formed else None
    return result


def gateway_point(daemon: Daemon, corpus: Corpus, concurrency: int, timing: Timing) -> dict:
    """KServe v2 REST JSON, a BYTES tensor of one text; http.client keep-alive per thread."""
    bodies = [json.dumps({"inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES",
                                      "data": [text]}]}).encode() for text in corpus.texts]
    local = threading.local()

    def call(index: int):
        connection = getattr(local, "connection", None)
        if connection is None:
            connection = local.connection = http.client.HTTPConnection(daemon.http, timeout=60)
        connection.request("POST", f"/v2/models/{daemon.model}/infer", body=bodies[index],
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        content = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {content[:200]!r}")
        return torch.tensor(json.loads(content)["outputs"][0]["data"])

    window = Window(timing.warmup_s, timing.duration_s)
    return run_threads(call, concurrency, window, SAMPLE, lambda i, y: logits_match(corpus, i, y))


def first_after_ready(daemon: Daemon, corpus: Corpus, steady_requests: int = 15) -> dict:
    """The first request after READY (a text of the most common bucket), then the same text
    ``steady_requests`` times more, one at a time: first / steady p50, from the client."""
    from modelwarden import Client

    text = corpus.texts[0]
    timings = []
    with Client(daemon.endpoint, timeout=60) as client:
        client.hello()  # the connection's own set-up is not the model's first request
        for _ in range(1 + steady_requests):
            started = time.perf_counter()
            client.infer(daemon.model, [text])
            timings.append((time.perf_counter() - started) * 1000)
    steady = statistics.median(timings[1:])
    return {"first_ms": round(timings[0], 2), "steady_p50_ms": round(steady, 2),
            "tokens": corpus.lengths[0]}


def handlers_missing() -> str | None:
    """Why the example service cannot run on this modelwarden, or None."""
    import importlib.util

    from modelwarden.shared.config import SOURCE_SCHEMES

    if importlib.util.find_spec("modelwarden.handler") is None or "handler" not in SOURCE_SCHEMES:
        return ("modelwarden and gateway: skipped, this modelwarden has no handlers "
                "(modelwarden.handler, source = \"handler:...\"; issue 23 part H)")
    return None


def gateway_missing() -> str | None:
    import importlib.util

    for name in ("uvicorn", "starlette"):
        if importlib.util.find_spec(name) is None:
            return f"gateway: skipped, {name} is not installed (pip install '.[gateway]')"
    return None


def bench_modelwarden(workdir: Path, corpus: Corpus, systems: list[str], levels: list[int],
                      timing: Timing, notes: list[str], extra: dict) -> list[dict]:
    missing = handlers_missing()
    if missing:
        return _note(notes, missing)
    with_gateway = "gateway" in systems and not _gateway_note(notes)
    rows = []
    for label, buckets in (("buckets on", True), ("buckets off", False)):
        try:
            daemon = start_daemon(workdir, f"mw {label}", example_model(EXAMPLE, buckets), with_gateway)
        except RuntimeError as exc:
            _note(notes, f"modelwarden {label}: did not start: {str(exc).splitlines()[0]}")
            print(exc, flush=True)
            continue
        try:
            if buckets:
                extra["first_after_ready"] = first_after_ready(daemon, corpus)
            rows += _daemon_points(daemon, corpus, systems, label, levels, timing, with_gateway)
        finally:
            stop_process(daemon.process)
    return rows


def _daemon_points(daemon, corpus, systems, label, levels, timing, with_gateway) -> list[dict]:
    rows = []
    if "modelwarden" in systems:
        for concurrency in levels:
            result = native_point(daemon, lambda i: [corpus.texts[i]],
                                  lambda i, y: logits_match(corpus, i, y), concurrency, timing)
            rows.append(point("modelwarden", "native", label, WORKLOAD, concurrency, result))
    if with_gateway:
        for concurrency in levels:
            rows.append(point("gateway", "REST JSON", label, WORKLOAD, concurrency,
                              gateway_point(daemon, corpus, concurrency, timing)))
    return rows


def _gateway_note(notes: list[str]) -> str | None:
    missing = gateway_missing()
    if missing:
        _note(notes, missing)
    return missing


def _note(notes: list[str], text: str) -> list:
    notes.append(text)
    print(f"note: {text}", flush=True)
    return []


def client_tokenizer():
    """The client-side example's tokenising, per text: ids padded to the text's bucket edge."""
    tokenizer = wordpiece()

    def encode(text: str) -> list[torch.Tensor]:
        ids = tokenizer.encode(text).ids
        edge = bucket_edge(len(ids))
        padded = torch.zeros(1, edge, dtype=torch.int64)
        padded[0, :len(ids)] = torch.tensor(ids)
        mask = torch.zeros(1, edge, dtype=torch.int64)
        mask[0, :len(ids)] = 1
        return [padded, mask]

    return encode


def bench_client_tokenizing(workdir: Path, corpus: Corpus, levels: list[int], timing: Timing,
                            notes: list[str]) -> list[dict]:
    model = example_model(CLIENT_EXAMPLE)
    try:
        daemon = start_daemon(workdir, "client tokenizing", model, False)
    except RuntimeError as exc:
        return _note(notes, f"clienttok: did not start: {exc}")
    encode = client_tokenizer()

    def check(index, output):
        return torch.allclose(output[0], corpus.embeddings[index], atol=1e-4)

    rows = []
    try:
        for concurrency in levels:
            result = native_point(daemon, lambda i: encode(corpus.texts[i]), check, concurrency, timing)
            rows.append(point("clienttok", "native", "minilm.toml, client pads to bucket", WORKLOAD,
                              concurrency, result))
    finally:
        stop_process(daemon.process)
    return rows


# -- peers -------------------------------------------------------------------------------------


def bench_text_peer(name: str, workdir: Path, files: tuple[Path, Path], levels: list[int],
                    timing: Timing, notes: list[str]) -> list[dict]:
    problem = install_peer(PEERS[name], PEER_EXTRA)
    if problem is not None:
        return _note(notes, f"{name}: {problem}")
    spec, data = files
    try:
        process, url, fmt = start_text_peer(name, workdir, spec, data)
    except RuntimeError as exc:
        _note(notes, f"{name}: did not start: {str(exc).splitlines()[0]}")
        print(exc, flush=True)
        return []
    try:
        return [point(name, PEERS[name].transport, f"batch {BATCH}, wait 2ms", WORKLOAD, concurrency,
                      text_peer_point(name, url, fmt, data, concurrency, timing))
                for concurrency in levels]
    finally:
        stop_peer(process)


# -- targets -----------------------------------------------------------------------------------


def row_of(rows: list[dict], system: str, concurrency: int, config: str | None = None) -> dict | None:
    found = [row for row in rows if row["system"] == system and row["concurrency"] == concurrency
             and row.get("rps") and (config is None or row["config"] == config)]
    return found[0] if found else None


def best_peer(rows: list[dict], concurrency: int, key: str = "rps") -> dict | None:
    found = [row for row in rows if row["system"] in TEXT_PEERS and row["concurrency"] == concurrency
             and row.get(key) is not None and row.get("rps")]
    if not found:
        return None
    return max(found, key=lambda row: row[key]) if key == "rps" else min(found, key=lambda row: row[key])


def targets(rows: list[dict], corpus: Corpus, extra: dict) -> list[dict]:
    costs = corpus.costs
    on64 = row_of(rows, "modelwarden", 64, "buckets on")
    off64 = row_of(rows, "modelwarden", 64, "buckets off")
    peer64, fastest = best_peer(rows, 64), best_peer(rows, 64, "p99_ms")
    client64 = row_of(rows, "clienttok", 64)
    on16 = row_of(rows, "modelwarden", 16, "buckets on")
    first = extra.get("first_after_ready")
    sla = extra["sla_bound_ms"] = round(2.0 + 2 * costs["batch16_bucketed_ms"] + 5.0, 2)
    report = [
        check("W4@64 buckets on / off, sentences/s", ratio(on64, off64), ">=", 1.5,
              f"in-process batch-16 forward at 16/32/64/128 tokens: "
              f"{'/'.join(str(costs[f'batch16_at_{e}_ms']) for e in (16, 32, 64, 128))} ms, bucket "
              f"shares {costs['bucket_shares']}; mean batch on {_get(on64, 'mean_batch')}, "
              f"off {_get(off64, 'mean_batch')}"),
        check("W4@64 ours native / best peer, sentences/s", ratio(on64, peer64), ">=", 1.3,
              f"vs {_who(peer64)}; mean batch ours {_get(on64, 'mean_batch')}; ours p50 "
              f"{_get(on64, 'p50_ms')} ms, peer p50 {_get(peer64, 'p50_ms')} ms"),
        check("W4@64 p99 ours native / best peer", ratio(on64, fastest, "p99_ms"), "<=", 0.7,
              f"vs {_who(fastest)}: p99 {_get(on64, 'p99_ms')} vs {_get(fastest, 'p99_ms')} ms"),
        check("W4@64 server-side / client-side tokenizing, sentences/s", ratio(on64, client64),
              ">=", 0.9, f"tokenising one text here takes {costs['tokenize_one_us']} us; the "
              f"client side batched {_get(client64, 'mean_batch')} per batch, ours "
              f"{_get(on64, 'mean_batch')}"),
        check("W4 first request after READY / steady p50",
              first and first["first_ms"] / first["steady_p50_ms"], "<=", 1.5,
              f"first {_get(first, 'first_ms')} ms, then p50 {_get(first, 'steady_p50_ms')} ms "
              f"(the same {_get(first, 'tokens')}-token text, 1 in flight)"),
        check("W4@16 p99 (ms) <= max_delay + 2 x batch-16 forward + 5 ms", _get(on16, "p99_ms", None),
              "<=", sla, f"max_delay 2 ms, one batch-16 forward {costs['batch16_bucketed_ms']} ms "
              f"(at each bucket's edge, weighted by the mix; at 128 tokens "
              f"{costs['batch16_at_128_ms']} ms, the mix unbucketed {costs['batch16_mix_ms']} ms); "
              f"p50 {_get(on16, 'p50_ms')} ms, mean batch {_get(on16, 'mean_batch')}"),
    ]
    return report


def _get(row: dict | None, key: str, default="n/a"):
    return row.get(key, default) if row else default


def _who(row: dict | None) -> str:
    return f"{row['system']} {row['config']}" if row else "no peer measured"


# -- report ------------------------------------------------------------------------------------


def print_table(rows: list[dict], corpus: Corpus) -> None:
    costs = corpus.costs
    print(f"\nW4: {len(corpus.texts)} texts, {min(corpus.lengths)}-{max(corpus.lengths)} tokens, "
          f"mean {costs['mean_tokens']}, per bucket {costs['bucket_shares']}; in-process, 1 thread: "
          f"batch-16 forward of the mix {costs['batch16_mix_ms']} ms, at 128 tokens "
          f"{costs['batch16_at_128_ms']} ms; tokenising one text {costs['tokenize_one_us']} us")
    header = (f"{'infl':>4s} {'system':12s} {'transport':18s} {'config':36s} {'sent/s':>8s} "
              f"{'p50 ms':>8s} {'p99 ms':>8s} {'err':>4s} {'batch':>5s}")
    print(header + "\n" + "-" * len(header))
    order = {name: n for n, name in enumerate(SYSTEMS)}
    for row in sorted(rows, key=lambda r: (r["concurrency"], order.get(r["system"], 99))):
        print(f"{row['concurrency']:>4d} {row['system']:12s} {row['transport']:18s} {row['config']:36s} "
              f"{row.get('rps') or 0:>8.1f} {_cell(row.get('p50_ms'))} {_cell(row.get('p99_ms'))} "
              f"{row.get('errors') if row.get('errors') is not None else '-':>4} "
              f"{row.get('mean_batch') or '-':>5}")


def _cell(value) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8s}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 s warm-up + 3 s window per point")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    parser.add_argument("--concurrency", default="1,16,64", help="requests in flight per point")
    parser.add_argument("--no-peers", action="store_true", help="no mosec, litserve, pytriton")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "text.json"))
    args = parser.parse_args(argv)
    args.systems = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {sorted(unknown)}")
    if args.no_peers:
        args.systems = [name for name in args.systems if name not in TEXT_PEERS]
    args.levels = [int(level) for level in args.concurrency.split(",")]
    return args


def run(args, workdir: Path, notes: list[str], extra: dict) -> tuple[list[dict], Corpus]:
    timing = Timing(1.0, 3.0) if args.quick else Timing(2.0, 8.0)
    corpus, handler = make_corpus(args.quick)
    rows: list[dict] = []
    if {"modelwarden", "gateway"} & set(args.systems):
        print("modelwarden: examples/textclassifier.toml (ZeroMQ ipc and KServe REST)", flush=True)
        rows += bench_modelwarden(workdir, corpus, args.systems, args.levels, timing, notes, extra)
    if "clienttok" in args.systems:
        print("client-side tokenizing: examples/minilm.toml", flush=True)
        rows += bench_client_tokenizing(workdir, corpus, args.levels, timing, notes)
    peers = [name for name in args.systems if name in TEXT_PEERS]
    if peers:
        files = write_peer_files(workdir, handler, corpus.texts, corpus.logits, ATOL)
        for name in peers:
            print(f"{name} ({PEERS[name].transport}, 2 workers x 1 thread)", flush=True)
            rows += bench_text_peer(name, workdir, files, args.levels, timing, notes)
    return rows, corpus


def main(argv=None) -> int:
    from modelwarden.minilm import EXTRA_MISSING, available

    args = parse_args(argv)
    if not available():
        print(EXTRA_MISSING, file=sys.stderr)
        return 2
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="mwtext-", dir="/tmp"))
    notes: list[str] = []
    extra: dict = {}
    try:
        rows, corpus = run(args, workdir, notes, extra)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, corpus)
    report = targets(rows, corpus, extra)
    write_results(args.json, rows, report, notes, started, {
        "machine": machine(), "command": command(), "quick": args.quick,
        "workload": {"texts": len(corpus.texts), "seed": SEED, "mix": MIX, "lengths": corpus.lengths,
                     "costs": corpus.costs},
        "peers": {name: {"requirements": list(PEERS[name].requirements + PEER_EXTRA),
                         "transport": PEERS[name].transport} for name in TEXT_PEERS
                  if name in args.systems}, **extra})
    errors = sum(row.get("errors") or 0 for row in rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
