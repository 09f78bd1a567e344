# The README's two commands: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch 2.13.0 is installed first, so the project's torch range resolves to it
# instead of pulling CUDA wheels. On a GPU machine: make TORCH_SPEC=torch install
TORCH_SPEC ?= torch==2.13.0
ASSETS ?= assets/tiny
PYTEST_ARGS ?=
# `make test` runs on pytest-xdist workers, one per core of CI's two: most of the suite's time is single-threaded
# (Python imports in each stage process, servers starting), so one worker leaves a core idle. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
# No telemetry from Prefect's server or MLflow: these machines reach no outside service.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true

.PHONY: install assets demo test test-slow bench clean lint lock

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $@

# The test extra: TRL (the reference), moto/s3fs (local S3), pytest, ruff and mypy.
$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

install: $(BIN)/.installed-test

# Always asked: make-tiny returns at once when the folder matches this version's assets, and remakes it otherwise.
assets: $(BIN)/.installed
	$(BIN)/alignpipe make-tiny $(ASSETS)

$(ASSETS)/ASSETS.json: assets

demo: $(BIN)/.installed assets
	$(BIN)/alignpipe run pipelines/tiny-demo.yaml

LINTED := alignpipe tasks flows tests bench
lint: $(BIN)/.installed-test
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/mypy alignpipe tasks flows bench
	$(BIN)/mypy tests --disable-error-code func-returns-value  # the spies' `calls.append(x) or f(x)`

test: $(BIN)/.installed-test
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-slow: $(BIN)/.installed-test
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

bench: $(BIN)/.installed-test assets
	$(BIN)/python -m bench --models tiny,small --repeats 3

# Re-pin constraints.txt to what is installed now (after a pyproject change and a green `make lint test`).
lock: $(BIN)/.installed-test
	{ sed -n '1,2p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | grep -v '^torch==\|^#' | sort -f; } > constraints.tmp
	mv constraints.tmp constraints.txt

clean:
	rm -rf runs .pytest_cache
