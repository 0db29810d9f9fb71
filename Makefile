# Two commands do all the set-up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)

.PHONY: run test static-checks lint typecheck bench tools clean lock airflow airflow-cli image image-tools

# Airflow in its own venv: its pins clash with the node's (requirements.lock constrains .venv),
# so the DAG tests run it through subprocesses (tests/airflow/runner.py). Installed once.
AIRFLOW_VENV  := .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed-airflow-3.3.2
# PySpark 4.2.0 and pandas<3: the spark provider's pyspark-client (newest 4.2.0) writes into
# pyspark/ too, and a newer pyspark would mix its jars with 4.2.0's Python files unseen.
AIRFLOW_PKGS  := apache-airflow==3.3.2 apache-airflow-providers-http \
	apache-airflow-providers-apache-spark apache-airflow-providers-cncf-kubernetes \
	'pyspark==4.2.0' 'pandas<3' 'kubernetes<37'

# Four pytest workers on two cores: a test waits on processes, fsyncs, leases and timers for
# about half its time (the suite's CPU over its workers' time, measured per test in a cgroup),
# so fewer workers left the cores idle. Whole files go to one worker (their module fixtures, a
# node or a cluster, start once), in the order tests/conftest.py gives (LONGEST_FILES first).
# `make test PYTEST_WORKERS=` runs in one process.
PYTEST_WORKERS ?= -n 4 --dist loadfile --no-loadscope-reorder

# The runtime libraries at the versions of requirements.lock, as in the image (Dockerfile):
# the tests run against what ships, and tests/deploy checks the lock against this venv.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' --constraint requirements.lock
	@rm -f $(VENV)/.installed-*
	@touch $@

$(AIRFLOW_STAMP):
	@test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python -m pip install -q $(AIRFLOW_PKGS)
	@touch $@

.venv-airflow: $(AIRFLOW_STAMP)

## Airflow on 127.0.0.1:$(AIRFLOW_PORT) with dags/, working through static discovery on the
## nodes of a running `make cluster` (./cluster's, or AIRFLOW_CLUSTER=DIR's: the Variable
## storage_node_metadata is then its store's URL) or else on the local node (make run); its
## state in ./airflow-home. Ctrl-C stops it and every process it started
## (tools/airflow_local.py; the command is not echoed: it holds the token). `make airflow-cli
## ARGS="dags list"` runs the CLI in the same setup. tests/airflow/test_local.py overrides the
## variables below.
AIRFLOW_PORT      := 8081
AIRFLOW_HOME_DIR  := $(CURDIR)/airflow-home
AIRFLOW_NODE_URL  := http://127.0.0.1:8080
AIRFLOW_CLUSTER   ?=
# ./cluster is looked at only when no node URL was given (a command line's wins over it).
AIRFLOW_CLUSTER_PROBE := $(if $(filter file,$(origin AIRFLOW_NODE_URL)),$(CURDIR)/cluster)
# The workers reach the API server through the execution API, which Airflow would look for on
# 8080 (the node's port) unless told.
AIRFLOW_ENV = AIRFLOW_HOME=$(AIRFLOW_HOME_DIR) AIRFLOW__CORE__LOAD_EXAMPLES=False \
	AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags \
	AIRFLOW__API__HOST=127.0.0.1 AIRFLOW__API__PORT=$(AIRFLOW_PORT) \
	AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$(AIRFLOW_PORT)/execution/ \
	AIRFLOW_VAR_STORAGE_NODE_DISCOVERY='{"kind": "static", "urls": ["$(AIRFLOW_NODE_URL)"]}' \
	AIRFLOW_CONN_STORAGE_NODE='{"conn_type": "http", "password": "$(NODE_ADMIN_TOKEN)"}' \
	AIRFLOW_CLUSTER=$(AIRFLOW_CLUSTER) AIRFLOW_CLUSTER_PROBE=$(AIRFLOW_CLUSTER_PROBE) \
	PATH=$(CURDIR)/$(AIRFLOW_VENV)/bin:$$PATH

# exec: make passes a SIGTERM on to its child, which a shell in between would not.
airflow: $(AIRFLOW_STAMP)
	@$(AIRFLOW_ENV) exec $(AIRFLOW_VENV)/bin/python tools/airflow_local.py

airflow-cli: $(AIRFLOW_STAMP)
	@$(AIRFLOW_ENV) exec $(AIRFLOW_VENV)/bin/python tools/airflow_local.py cli $(ARGS)

## Start the node with embedded defaults: data in ./data, file journal, on 127.0.0.1:8080.
run: $(STAMP)
	$(PY) -m node serve

## System tools of the tests and benchmarks: fio (the raw-device WAL's baseline), a Java
## runtime for Spark (the audit job; Debian 12's default is OpenJDK 17, which Spark 4 needs),
## Prometheus with promtool (tests/monitoring runs the binary on a free loopback port; the
## Debian service the package enables is stopped: the tests never use it or port 9090),
## redis-server, the peer of `bench http --peer redis` (its Debian service is stopped too: the
## bench starts its own on a free loopback port), Debian's chromium (tests/status drives it
## with Playwright: no browser download), npm (installs axe-core for the status page's
## accessibility test), etcd-server (tests/client start etcd on free loopback ports; the Debian
## service on :2379 is stopped) and, through image-tools, podman and what it needs (tests/deploy).
tools: image-tools
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)
	@command -v npm >/dev/null || (apt-get update && apt-get install -y --no-install-recommends npm)
	@command -v fio >/dev/null || (apt-get update && apt-get install -y --no-install-recommends fio)
	@command -v java >/dev/null || (apt-get update && apt-get install -y --no-install-recommends default-jre-headless)
	@command -v promtool >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus \
		&& (systemctl disable --now prometheus 2>/dev/null || service prometheus stop 2>/dev/null || true))
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y --no-install-recommends redis-server \
		&& (systemctl disable --now redis-server 2>/dev/null || service redis-server stop 2>/dev/null || true))
	@command -v etcd >/dev/null || (apt-get update && apt-get install -y --no-install-recommends etcd-server \
		&& (systemctl disable --now etcd 2>/dev/null || service etcd stop 2>/dev/null || true))

# --- the image ---------------------------------------------------------------------------------
## The image storage-node:<version> from the Dockerfile (tools/image.py): podman, or
## docker where its daemon answers; on a Debian base made with debootstrap when the official
## python image cannot be pulled. Skipped when an image of the same inputs exists.
image:
	$(PYTHON) -m tools.image

## podman, buildah and runc (Debian's default crun refuses hybrid cgroups), catatonit (the
## pause process of `podman kube play`), debootstrap (the local base); run by `make tools`.
image-tools:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v buildah >/dev/null \
		&& command -v catatonit >/dev/null && command -v debootstrap >/dev/null \
		|| (apt-get update && apt-get install -y --no-install-recommends podman buildah runc \
			catatonit debootstrap)


# axe-core for the status page's accessibility test, at the version of its lock file, in a
# git-ignored node_modules (tests/status).
AXE := tests/status/node_modules/axe-core/axe.min.js
$(AXE): tests/status/package.json tests/status/package-lock.json | tools
	cd tests/status && npm ci --no-audit --no-fund
	@touch $@

## Lint, type-check and run the whole test suite.
test:
	@# The set-up's parts side by side: pip installing from its cache is CPU-bound, and on a
	@# fresh clone the two venvs took 165 s one after the other, 125 s together; the checks
	@# of the code run once .venv is in, while Airflow's venv (the longer) still installs.
	@$(MAKE) --no-print-directory -j3 static-checks $(AIRFLOW_STAMP) $(AXE)
	$(PY) -m pytest -q --durations=15 $(PYTEST_WORKERS)

# What `make test` runs before the suite: lint, types, and the bytecode up front (the suite
# starts hundreds of node and tool processes, each of which would otherwise compile node/
# anew where PYTHONDONTWRITEBYTECODE is set: a fifth of a node's start).
static-checks: $(STAMP)
	$(PY) -m ruff check node tests grafana dags tools
	$(PY) -m mypy
	$(PY) -m mypy dags
	$(PY) -m compileall -q -j 0 node dags tests tools > /dev/null

lint: $(STAMP)
	$(PY) -m ruff check node tests grafana dags tools
	$(PY) -m ruff format --check node tests grafana dags tools
	$(PY) -m grafana.generate --check

typecheck: $(STAMP)
	$(PY) -m mypy
	$(PY) -m mypy dags

bench: $(STAMP)
	$(PY) -m node bench write

## After changing the runtime dependencies: install them, then pin what was installed.
lock:
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m tests.deploy.lockfile > requirements.lock

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) .pytest_cache .mypy_cache .ruff_cache

## 200 seeded fault runs against etcd and five local nodes (node/jepsen): random writers, a
## random nemesis (node kill or pause, a partition, a delay, held acks, etcd down, a writer
## killed, a ledger recovered while its writer writes), recovery, then the checker's verdict;
## exit 1 on any violation. Not in `make test`
## (about 20-30 minutes on 2 cores). JEPSEN_SEED picks the first run's seed.
.PHONY: jepsen
JEPSEN_SEED ?= 0
jepsen: $(STAMP) tools
	$(PY) -m node bench jepsen --runs 200 --seed $(JEPSEN_SEED) --seconds 2

## etcd and NODES nodes (4: n0..n3; a 3/3/2 ledger needs three writable nodes, so one can be
## lost) on loopback with their data under ./cluster/, in the foreground, to try replicated
## ledgers (docs/replication.md): it prints the metadata store's URL (the export line to
## paste), the nodes' URLs and how to point `python -m node shell` at them; Ctrl-C stops them
## all. Run again, the same cluster comes back; remove ./cluster/ for a new one. Needs etcd
## (make tools). It says when a node or etcd exits.
NODES ?= 4
.PHONY: cluster cluster-node
cluster: $(STAMP)
	@exec $(PY) -m node.devcluster --nodes $(NODES)

## One node (or etcd) of the running `make cluster`: `make cluster-node ID=n1 DO=stop` (SIGTERM;
## DO=kill: SIGKILL), `make cluster-node ID=n1` starts it again on its port and data directory
## (DO=restart: kill, then start). No venv check: a cluster runs, so the venv is there.
DO ?= start
cluster-node:
	@test -n "$(ID)" || { echo "make cluster-node ID=n1 [DO=start|stop|kill|restart]" >&2; exit 2; }
	@$(PY) -m node.devcluster node $(ID) $(DO)
