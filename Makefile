PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip

.PHONY: setup test test-fast lint clean image-check

setup:
	bash scripts/setup.sh $(PY) $(VENV)

test:
	$(VENV)/bin/python -m pytest -q --durations=25 tests bench/tests

test-fast:
	$(VENV)/bin/python -m pytest -q tests bench/tests -m "not integration"

lint:
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/hadolint --config docker/hadolint.yaml docker/Dockerfile.cpu docker/Dockerfile.gpu

# Builds docker/Dockerfile.cpu and asks the running image the README's question (root, buildah; not in CI).
image-check:
	bash scripts/image-check.sh

clean:
	rm -rf $(VENV) build dist
