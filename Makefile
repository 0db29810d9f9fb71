# Two commands do all the set-up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)

.PHONY: run test lint typecheck bench tools clean lock

# The runtime libraries at the versions of requirements.lock, as in the image (Dockerfile):
# the tests run against what ships, and tests/deploy checks the lock against this venv.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' --constraint requirements.lock
	@rm -f $(VENV)/.installed-*
	@touch $@

## Start the node with embedded defaults: data in ./data, file journal, on 127.0.0.1:8080.
run: $(STAMP)
	$(PY) -m node serve

## System tools of the tests and benchmarks: fio (the raw-device WAL's baseline), a Java
## runtime for Spark (the audit job; Debian 12's default is OpenJDK 17, which Spark 4 needs),
## and Prometheus with promtool (tests/monitoring runs the binary on a free loopback port; the
## Debian service the package enables is stopped: the tests never use it or port 9090).
tools:
	@command -v fio >/dev/null || (apt-get update && apt-get install -y --no-install-recommends fio)
	@command -v java >/dev/null || (apt-get update && apt-get install -y --no-install-recommends default-jre-headless)
	@command -v promtool >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus \
		&& (systemctl disable --now prometheus 2>/dev/null || service prometheus stop 2>/dev/null || true))

## Lint, type-check and run the whole test suite.
test: $(STAMP) tools
	$(PY) -m ruff check node tests grafana
	$(PY) -m mypy
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check node tests grafana
	$(PY) -m ruff format --check node tests grafana
	$(PY) -m grafana.generate --check

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m node bench write

## After changing the runtime dependencies: install them, then pin what was installed.
lock:
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m tests.deploy.lockfile > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
