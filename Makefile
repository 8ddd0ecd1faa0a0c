# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Python 3.12 where the machine has it, on PATH or installed by pyenv (else python3, 3.11 or later):
# coverage.py's sys.monitoring core (3.12+, pyproject's [tool.coverage.run]) measures the suite's
# lines at almost no cost, where 3.11's tracer added ~45 % to its compute-bound tests.
PY      ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12; do \
             $$p -c '' >/dev/null 2>&1 && { echo $$p; exit; }; done; echo python3)
VENV    := .venv
# Bytecode caches on, whatever the environment says (some set PYTHONDONTWRITEBYTECODE=1): without
# them every test worker re-rewrites every test module's asserts and every `dctms` subprocess
# compiles the package again (the quick loop measured 136-138 s with the variable set, 120-121 s
# without, 2026-12-03 on the 2-core development machine). __pycache__/ is git-ignored.
unexport PYTHONDONTWRITEBYTECODE
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo serve-demo test test-quick lint plans bench docs setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[cpu,test]'
	@command -v dot >/dev/null 2>&1 || { \
	  echo "installing the Graphviz 'dot' binary (apt-get)"; \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || \
	  echo "warning: could not install graphviz; svg/png export tests will be skipped"; }
	@[ "$$(uname -s)" != Linux ] || [ -e /usr/lib/$$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3 ] || { \
	  echo "installing OpenBLAS (apt-get libopenblas0-pthread): MLX's Linux wheel bundles the reference BLAS"; \
	  (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null) || \
	  echo "warning: could not install libopenblas0-pthread; MLX runs on its reference BLAS (slow)"; }
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dctms demo

# The demo model behind an OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C stops):
# SmolLM2-135M-Instruct as `dctms demo` prepared it, or its tiny random fallback.
DEMO_CACHE = $${XDG_CACHE_HOME:-$$HOME/.cache}/dctms
serve-demo: $(STAMP)
	$(BIN)/dctms demo > /dev/null
	@if [ -f $(DEMO_CACHE)/smollm2/demo.plan ]; then \
	  spec=demo=$(DEMO_CACHE)/smollm2/demo.plan=$(DEMO_CACHE)/smollm2/smollm2-135m-instruct-float32; \
	else spec=demo=$(DEMO_CACHE)/demo-qwen2/demo.plan=$(DEMO_CACHE)/demo-qwen2; fi; \
	echo "$(BIN)/dctms serve --plan $$spec"; $(BIN)/dctms serve --plan $$spec

# The suite on one pytest-xdist worker per core (tests/conftest.py keeps each module on one worker
# and starts the heaviest first), with its line coverage: the total is printed and must not fall
# below COVERAGE_FLOOR (`.venv/bin/coverage report` lists every file afterwards).
PARALLEL       = -n auto --dist loadgroup --no-loadscope-reorder
COVERAGE_FLOOR = 88
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -p no:cacheprovider $(PARALLEL) --cov --cov-report= --cov-fail-under=$(COVERAGE_FLOOR)

# The quick local loop: everything but the tests marked slow. Its packing cache (toolkit.pack.memo)
# stays between runs in .pack-cache/ (git-ignored; `make test` starts from an empty one each run):
# the suite's compiles then skip the packer's search on a second run (128.5 s against 142.1 s,
# 2026-12-03 18:45, the 2-core development machine).
test-quick: $(STAMP)
	$(BIN)/ruff check .
	DCTMS_PACK_CACHE=$(CURDIR)/.pack-cache $(BIN)/pytest -q -p no:cacheprovider $(PARALLEL) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

# Re-compile the checked-in plans from their configs (a test fails when they drift).
plans: $(STAMP)
	$(BIN)/dctms compile plans/configs/qwen2.5-1.5b-instruct-4bit.json -N 2048 -M 256 -o plans/qwen1.5b.plan
	$(BIN)/dctms compile plans/configs/qwen2.5-7b-instruct-4bit.json -N 2048 -M 256 -o plans/qwen7b.plan

# The documentation site: the reference pages regenerated from the code (argparse parsers, plan
# schema, verifier registry), then `mkdocs build --strict` into site/ (tests/test_docs.py checks both).
docs: $(STAMP)
	$(BIN)/python scripts/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# Planner quality and speed, then the runner against stock mlx-lm (interleaved A/B, ratios).
bench: $(STAMP)
	$(BIN)/python bench/planner.py
	$(BIN)/python bench/runner_vs_mlx_lm.py
	$(BIN)/python bench/tui_startup.py

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .hypothesis *.egg-info .coverage .coverage.* .pack-cache
