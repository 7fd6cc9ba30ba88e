# The two README commands: `make demo` (main job on a built-in default) and `make test` (whole suite).
# Each creates .venv if missing and installs the project into it, with the extra `titan` (torchtitan), against
# whose config classes the suite checks `devplace export --format torchtitan`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,titan]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/devplace demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
