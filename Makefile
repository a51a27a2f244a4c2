# The two set-up commands (README): `make demo` and `make test`.
# Each creates .venv, installs the project with everything it needs, and runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# tensorflow-cpu by default; GPU users: make TF_EXTRA=gpu ...
TF_EXTRA ?= cpu

.PHONY: install test test-fast demo bench bench-core clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(TF_EXTRA),test,examples]"
	# tf_keras (legacy Keras, TF_USE_LEGACY_KERAS=1) matching the installed TF; --no-deps
	# because it names `tensorflow`, which would pull a second TF beside tensorflow-cpu.
	$(PY) -m pip install --quiet --no-deps "tf_keras~=$$($(PY) -c 'import tensorflow as t; print(t.__version__.rsplit(".", 1)[0])').0"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

# Single-process tests only (seconds).
test-fast: install
	$(PY) -m pytest -q tests -m "not multirank"

demo: install
	$(VENV)/bin/elastic-hvd-run -np 4 --faults "rank=2,coll=30,delay=0.005" \
		python examples/recovery_demo.py

bench-core: install
	$(PY) bench/core_bench.py --runs 5

bench: bench-core

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
