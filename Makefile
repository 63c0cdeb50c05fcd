# raymoe developer commands. `make test` and `make demo` work from a fresh clone: they create .venv and
# install the CPU build of torch that lies on this machine's disk (torch==2.13.0) before anything else.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test lint demo bench-offline clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

lint: install
	$(PY) -m ruff check raymoe tests benchmarks

test: install lint
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/raymoe generate --prompt "def fib(n):" --max-tokens 32

bench-offline: install
	$(VENV)/bin/raymoe bench offline --num-prompts 64 --input-len 10 --output-len 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache bench_results
