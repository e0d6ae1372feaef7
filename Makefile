PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip

.PHONY: setup test test-fast test-component lint clean image-check

# The tests as a pyramid (docs/operations.md): unit (in-process: no socket, no process; their conftests
# refuse both), component (fake engines and routers on loopback, child processes), integration (real vLLM
# engines, NIXL and Ray). The benchmarks' tests are laid out the same way: bench/tests, bench/tests/component.
UNIT := tests/unit bench/tests --ignore=bench/tests/component
COMPONENT := tests/component bench/tests/component

setup:
	bash scripts/setup.sh $(PY) $(VENV)

# Everything, the base first: unit, component, then integration (whose conftest runs its own-system modules last).
test:
	$(VENV)/bin/python -m pytest -q --durations=25 tests/unit bench/tests tests/component tests/integration

test-fast:
	$(VENV)/bin/python -m pytest -q $(UNIT)

test-component:
	$(VENV)/bin/python -m pytest -q --durations=10 $(COMPONENT)

lint:
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/hadolint --config docker/hadolint.yaml docker/Dockerfile.cpu docker/Dockerfile.gpu

# Builds docker/Dockerfile.cpu and asks the running image the README's question (root, buildah; not in CI).
image-check:
	bash scripts/image-check.sh

clean:
	rm -rf $(VENV) build dist
