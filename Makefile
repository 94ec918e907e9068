# Quick start: `make up` runs the main job, `make test` runs the test suite, `make check` its fast tier.
# All three create .venv and install on first use (CPU torch 2.13.0 first, then the project).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,megatron,ray,import,lora]"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/sao up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# Fast tier (< 3 min on 2 cores): ruff, then every test not marked slow, kafka, docker, browser or gpu.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow and not kafka and not docker and not browser and not gpu" $(ARGS)

.PHONY: install up test check
