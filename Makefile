# raymoe developer commands. `make test` and `make demo` work from a fresh clone: they create .venv and
# install the CPU build of torch that lies on this machine's disk (torch==2.13.0) before anything else.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test lint mutation demo serve generate bench-offline bench-serve clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

lint: install
	$(PY) -m ruff check raymoe tests benchmarks
	$(VENV)/bin/lint-imports

test: install lint
	$(PY) -m pytest -q

# Mutation testing with mutmut ([tool.mutmut] in pyproject.toml): each mutant of the TBO decision and split, the
# all-to-all plan, the scheduler's batch formation, retraction and failure paths and the radix cache runs against the
# fast unit tests that reach its function. Prints the score per file and fails when a file scores below 90 %
# (tests/mutation_report.py; mutants no test can kill: tests/mutation_equivalents.txt). Run before each release
# (README, "Tests"); too long for `make test`.
mutation: install
	rm -rf mutants
	$(PY) -m mutmut run
	$(PY) tests/mutation_report.py --min-score 90

# The main job: the OpenAI-compatible server (demo checkpoint, dp=2 x ep=2 rank actors; two-batch overlap on CUDA ranks) on
# 127.0.0.1:8000; once ready it answers one chat completion itself and prints a curl line. Ctrl-C stops it.
demo: install
	$(VENV)/bin/raymoe serve --demo-request

serve: install
	$(VENV)/bin/raymoe serve

generate: install
	$(VENV)/bin/raymoe generate --prompt "def fib(n):" --max-tokens 32

bench-offline: install
	$(VENV)/bin/raymoe bench offline --num-prompts 64 --input-len 10 --output-len 64

# Against a running server (make serve in another terminal): MT-Bench two-turn chats.
bench-serve: install
	$(VENV)/bin/raymoe bench serve --base-url http://127.0.0.1:8000 --concurrency 16 --num-prompts 80 \
		--dataset-path ../shared/data/mt_bench_questions.jsonl --output-len 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache bench_results mutants
