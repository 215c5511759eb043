# The two commands of the README: `make demo` trains the default job, `make test` runs lint,
# type check and tests. Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest test-slow test-slurm slurm-packages test-s3 chaos clean browser

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing torch (CPU) and dtrain with its dev extras;"
	@echo "make: a few minutes the first time (pip's progress below), seconds after that"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build on these machines. A bare `torch` requirement
	# could otherwise pull a multi-GB CUDA build. Not --quiet: a first install takes minutes,
	# and pip's progress is the only sign of life.
	$(PY) -m pip install --disable-pip-version-check --progress-bar on torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -e '.[dev]'
	touch $(STAMP)

# The default job in a run folder of its own, then what to run on it next.
demo: $(STAMP)
	@run=runs/demo-$$(date +%Y%m%d-%H%M%S) && $(VENV)/bin/dtrain train --run.dir=$$run && \
	echo && echo "next, on this run (after . $(VENV)/bin/activate):" && \
	echo "  plots and an HTML page:   dtrain report $$run" && \
	echo "  where it stands:          dtrain status $$run" && \
	echo "  the weights as one file:  dtrain export $$run model.safetensors" && \
	echo "  train it further:         dtrain train --run.dir=$$run --train.steps=1400" && \
	echo "  Ctrl-C during a run saves it; the same command resumes it, bit for bit"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The tests spend most of their time waiting (ranks starting, collectives, timeouts), not
# computing: several pytest workers share the cores. Tests on namespace hosts share one
# subnet and run in one worker (xdist_group). PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 4
pytest: $(STAMP) browser
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

# The report's test opens the HTML report in headless Chromium (Debian's chromium package):
# installed here when missing and this can (root, apt-get); otherwise that one test skips and
# says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get) for the report's browser test"; \
		{ apt-get install -y -qq chromium >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } || \
		echo "note: apt-get could not install chromium; the report's browser test will skip"; \
	else \
		echo "note: chromium is missing and cannot be installed here (needs root and apt-get);" \
			"the report's browser test will skip"; \
	fi

test: lint typecheck pytest

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Slurm for real (about 2 minutes): the recipe of docs/multi-host.md on a two-node cluster made
# on this machine by scripts/slurm.sh. Debian's Slurm packages are installed when missing and
# this can (root, apt-get); otherwise the test skips and says why.
test-slurm: $(STAMP) slurm-packages
	$(PY) -m pytest -q -m "slow or not slow" tests/test_slurm.py

# A run folder in a real object store: OpenStack Swift's S3 API on this machine
# (scripts/s3.sh; Debian's packages installed when missing, 3-4 minutes), the whole of
# tests/test_s3_run_dir.py against it (train, kill -9 and resume in the store, export, status).
test-s3: $(STAMP)
	PYTHON=$(PY) scripts/s3.sh up
	DTRAIN_TEST_S3_ENDPOINT=http://127.0.0.1:$${DTRAIN_S3_PORT:-18480} \
		$(PY) -m pytest -q -m "slow or not slow" tests/test_s3_run_dir.py tests/test_s3_shards.py; \
		code=$$?; scripts/s3.sh down; exit $$code

slurm-packages:
	@command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && \
		command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing slurmctld slurmd slurm-client munge (apt-get) for the Slurm test"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1; }; } || \
		echo "note: apt-get could not install the Slurm packages; the Slurm test will skip"; \
	else \
		echo "note: the Slurm packages are missing and cannot be installed here (needs root and apt-get);" \
			"the Slurm test will skip"; \
	fi

# The system test: every fault-injection trial through the real CLI, many times each (about
# 50 min on 2 cores); writes its table into docs/benchmarks.md. `make test-slow` runs the
# quick form (one trial of each kind).
chaos: $(STAMP)
	$(PY) -m tests.system.chaos

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
