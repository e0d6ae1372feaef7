PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip

.PHONY: setup test test-fast lint clean

setup:
	bash scripts/setup.sh $(PY) $(VENV)

test:
	$(VENV)/bin/python -m pytest -q --durations=25 tests

test-fast:
	$(VENV)/bin/python -m pytest -q tests -m "not integration"

lint:
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/hadolint --config docker/hadolint.yaml docker/Dockerfile.cpu docker/Dockerfile.gpu

clean:
	rm -rf $(VENV) build dist
