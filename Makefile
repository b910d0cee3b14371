# normscope: the two set-up commands live here.
#   make demo   the main job: a small GPT trained with DeadDirectionMonitor attached
#   make test   install everything into .venv, lint, and run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch first, pinned, so that pip never resolves an unpinned torch to a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv test lint demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

test: lint
	$(VENV)/bin/pytest -q

# The main job: a small pre-norm GPT trained on this machine's Python sources with
# DeadDirectionMonitor attached; logs to CSV and W&B (offline unless you are logged in).
demo: venv
	$(PY) -m examples.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
