# The README's two commands: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch 2.13.0 is installed first, so the project's torch range resolves to it
# instead of pulling CUDA wheels. On a GPU machine: make TORCH_SPEC=torch install
TORCH_SPEC ?= torch==2.13.0
ASSETS ?= assets/tiny
PYTEST_ARGS ?=
# No telemetry from Prefect's server or MLflow: these machines reach no outside service.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export MLFLOW_ENABLE_TELEMETRY ?= false

.PHONY: install demo test test-slow bench clean lint

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

$(ASSETS)/ASSETS.json: $(BIN)/.installed
	$(BIN)/alignpipe make-tiny $(ASSETS)

demo: $(BIN)/.installed $(ASSETS)/ASSETS.json
	$(BIN)/alignpipe run pipelines/tiny-demo.yaml

test: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(BIN)/.installed
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

bench: $(BIN)/.installed $(ASSETS)/ASSETS.json
	$(BIN)/python -m bench --models tiny,small --repeats 3

clean:
	rm -rf runs .pytest_cache
