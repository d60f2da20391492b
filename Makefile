# Two user-facing commands (see README.md):
#   make demo   quick benchmark on whatever hardware is here + analysis of an example mask
#   make test   the test suite (CPU by default; GPU tests are marked and skip without a GPU)
#   make test-models   the model-library integration tests (tests/test_models_*.py: penzai,
#               keras-hub, gemma under splat.sparsify; minutes of compiling, so not in `make test`)
#
# Both create .venv on first use and reuse it afterwards. The install is redone only when
# pyproject.toml changes: the stamp file's name carries a hash of it.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,plot,flax
PY := $(VENV)/bin/python
HASH := $(shell $(PYTHON) -c "import hashlib;print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest()[:12])")
STAMP := $(VENV)/.splat-installed-$(HASH)
OUT ?= benchmarks/out
PYTEST_ARGS ?=

.PHONY: demo test test-models venv lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# the distribution was called "splat" before (a name taken on the package index): drop that install
	@$(PY) -m pip uninstall -q -y splat >/dev/null 2>&1 || true
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@if nvidia-smi >/dev/null 2>&1; then \
		echo "nvidia-smi works: installing the CUDA extra"; \
		$(PY) -m pip install -q -e ".[cuda]"; \
	fi
	@rm -f $(VENV)/.splat-installed-*
	@touch $@

demo: $(STAMP)
	@mkdir -p $(OUT)
	$(VENV)/bin/splat bench --quick --out $(OUT)/demo-bench.json --plot $(OUT)/demo-bench.png
	$(VENV)/bin/splat analyze "sliding_window(256, 256) | global_tokens(4)" --q-len 2048 \
		--plot $(OUT)/demo-mask.png

# The suite runs in one process per core, up to 4 (pytest-xdist), each test file in one process:
# files share their fixtures and subprocesses (the sequence-parallel cases' device counts).
TEST_WORKERS ?= -n auto --maxprocesses 4 --dist loadfile

test: $(STAMP)
	$(PY) -m pytest $(TEST_WORKERS) $(PYTEST_ARGS)

# The model libraries are installed here, not by `make venv`: resolved together with the test
# extras from scratch, pip backtracks for many minutes through their google-cloud dependencies.
# jax stays at the installed version; a library that cannot be installed has its tests skip.
test-models: $(STAMP)
	$(PY) -m pip install -q -e ".[models]" "jax==$$($(PY) -c 'import jax; print(jax.__version__)')" \
		|| echo "could not install the models extra: its tests skip (pip install -e '.[models]' says why)"
	$(PY) -m pytest -m models tests/test_models_*.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check .

clean:
	rm -rf $(OUT) .pytest_cache .ruff_cache .hypothesis
