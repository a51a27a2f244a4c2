# The two set-up commands (README): `make demo` and `make test`.
# Each creates .venv, installs the project with everything it needs, and runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# tensorflow-cpu by default; GPU users: make TF_EXTRA=gpu ...
TF_EXTRA ?= cpu

.PHONY: install lint test test-fast check test-under-load test-tf215 demo soak bench bench-core bench-horovod bench-growth bench-hosts bench-mwms bench-tf-versions compat-horovod clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(TF_EXTRA),test,examples,torch]"
	# tf_keras (legacy Keras, TF_USE_LEGACY_KERAS=1) matching the installed TF; --no-deps
	# because it names `tensorflow`, which would pull a second TF beside tensorflow-cpu.
	$(PY) -m pip install --quiet --no-deps "tf_keras~=$$($(PY) -c 'import tensorflow as t; print(t.__version__.rsplit(".", 1)[0])').0"
	touch $@

install: $(VENV)/.installed

# Linter and type checker (ruff, mypy; settings in pyproject.toml): run first by `make test`.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# The tests run on TEST_WORKERS pytest-xdist workers: most of a test's time is waiting on
# its job, not computing.  Each worker's jobs have a TMPDIR of their own; a test marked
# `serial` (it steers the kernel's next pid, or keeps both cores busy) runs alone; the
# tests that start a job first, the quick single-process ones last (tests/conftest.py).
# (--dist loadgroup would keep a module's shared job on one worker, but pytest-xdist 3.8
# cannot mark the groups under pytest 9: worksteal, and such a job may run twice.)
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# Strict mode (ELASTIC_HVD_STRICT): any anomaly of the core ends the job that met it,
# and so fails its test, instead of being repaired and logged.
test: lint
	ELASTIC_HVD_STRICT=1 $(PYTEST) --durations=20

# Single-process tests only (< 2 min).
test-fast: install
	$(PYTEST) -m "not multirank"

# For a change under way (< 10 min on 2 cores): the linters, the single-process tests, and
# each subsystem once with real kills (the tests marked `check`: a loss inside a collective
# and in fit, a plain script's loss, a spare, a node loss, a fence, a respawn, a stop, a
# checkpoint writer killed, bad input, strict mode).  `make test` runs everything.
check: lint
	ELASTIC_HVD_STRICT=1 $(PYTEST) -m "check or not multirank" --durations=20

# Keras 2 / TF 2.15 (the last TF Horovod supports): the TF tests in their own venv.
# Not part of `make test` (a second TF install costs minutes).
test-tf215:
	$(PYTHON) -m venv .venv-tf215
	.venv-tf215/bin/python -m pip install --quiet --upgrade pip
	.venv-tf215/bin/python -m pip install --quiet "tensorflow-cpu==2.15.1" "numpy<2" -e ".[test]"
	ELASTIC_HVD_STRICT=1 .venv-tf215/bin/python -m pytest -q tests/test_tensorflow.py
	ELASTIC_HVD_STRICT=1 .venv-tf215/bin/python -m pytest -q tests/test_horovod_parity.py -k "$(HOROVOD_API_TESTS)"

# The API part of tests/test_horovod_parity.py (names and parameters: what test-tf215 checks).
HOROVOD_API_TESTS = every_horovod_module_is_mapped or not_provided_names or name_and_parameters or methods_and_properties or calls_before_init or every_public_class_and_function

demo: install
	$(VENV)/bin/elastic-hvd-run -np 4 --faults rank=2,step=40 python examples/fruits360/train.py

# Chaos soak (issue 18): a Keras job on 4 ranks (--respawn, strict mode) meets a fault every
# ~15 s (kill, stop, term, exception; random ranks, bursts, during repairs, joins,
# checkpoints) for SOAK_MINUTES while invariants are checked; output in runs/soak/.
# Not part of `make test`.  SOAK_ARGS: more driver flags, e.g. --seed N.
SOAK_MINUTES ?= 30
SOAK_ARGS ?=
soak: install
	$(PY) tests/soak/driver.py --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# make test beside a CPU hog (issue 18: failures seen only on a busy machine); HOGS busy
# processes at normal priority; prints the load average the run saw. Not part of `make test`.
HOGS ?= 6
test-under-load: install
	$(PY) bench/under_load.py --hogs $(HOGS) -- $(MAKE) test

bench-core: install
	$(PY) bench/core_bench.py --runs 5

# Real Horovod 0.28.1 side by side (builds it first: ~7 minutes, optional).
bench-horovod: install
	test -x .venv-horovod/bin/horovodrun || bash bench/build_horovod.sh
	$(PY) bench/vs_horovod.py
	$(PY) bench/recovery_vs_elastic_horovod.py --runs 3
	$(PY) bench/growth_vs_elastic_horovod.py --runs 3
	$(PY) bench/small_tensors.py --runs 3
	$(PY) bench/scaling_vs_horovod.py --runs 5

# Against TensorFlow's MultiWorkerMirroredStrategy (issue 23): throughput on 2 and 4
# workers, and a worker SIGKILLed (MWMS + BackupAndRestore restarting all vs ours in
# place); ~20 min on 2 cores. Not part of `make test`.
bench-mwms: install
	$(PY) bench/vs_mwms.py --runs 3 --kill-runs 3

# Where TF 2.21's step goes (issue 23): single-process MobileNetV2 fit on TF 2.21 / Keras 3
# and TF 2.15 / Keras 2 (.venv-tf215, made by test-tf215), alone and under elastic_hvd.
bench-tf-versions: install
	test -x .venv-tf215/bin/elastic-hvd-run || $(MAKE) test-tf215
	$(PY) bench/tf_versions.py --runs 3

# ElasticData against tf.data on the same 2048 JPEGs, 1 and 4 ranks, as fast as it can and
# beside a 20 ms step (issue 44): docs/benchmarks.md.  ~10 min.
.PHONY: bench-input
bench-input: install
	$(PY) bench/input_speed.py --runs 5 --ahead 0 --map

# Replacing a killed rank / adding ranks (issue 6).
bench-growth: install
	$(PY) bench/growth_bench.py --runs 3

# Each failure kind (a rank, a host's ranks, a node, a frozen host) on simulated hosts (root).
bench-hosts: install
	$(PY) bench/failure_kinds.py --runs 3

# How costs grow from 2 to 64 ranks, oversubscribed on this machine (issue 18): allreduce,
# agreement, detection + repair; fits, docs/scale.png. ~10 min. Not part of `make test`.
.PHONY: bench-scale
bench-scale: install
	$(PY) bench/scale.py --runs 4 --yield-check 8

# Horovod 0.28.1's own TF/Keras tests, each a 2-rank job, on Keras 3 then tf_keras (issue 19; ~1 h): docs/horovod-tests.md.
HOROVOD_SRC ?= ../.mirror/horovod+horovod/repo
compat-horovod: install
	$(PY) -m pip install --quiet cloudpickle mock parameterized
	$(PY) bench/horovod_suite.py --horovod-src $(HOROVOD_SRC) --keras 3 tf_keras

# Under a real Slurm (issue 46): Debian's slurm-wlm + munge (installed here if missing,
# as root), slurmctld and one slurmd per node, each node in its own network and UTS
# namespace (tests/slurm/cluster.py), and jobs through sbatch (tests/slurm/).  Stops
# everything it started, also when a test fails.  Not part of `make test`; docs/slurm.md.
.PHONY: test-slurm
test-slurm: install
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge)
	dir=$${SLURM_DIR:-$$(mktemp -d /tmp/ehvd-slurm-XXXXXX)}; \
	trap '$(PY) tests/slurm/cluster.py stop '"$$dir" EXIT; \
	ELASTIC_HVD_SLURM_TESTS=1 ELASTIC_HVD_SLURM_DIR=$$dir \
	  $(PY) -m pytest -q tests/slurm -p no:cacheprovider --durations=0 $(SLURM_TESTS); \
	status=$$?; cat $$dir/measures.jsonl 2>/dev/null; exit $$status

bench: bench-core bench-growth

clean:
	rm -rf $(VENV) .venv-tf215 .pytest_cache build *.egg-info
