# Thin wrapper over CMake. `make demo` and `make test` work on a fresh machine
# as root: they install what is missing, configure, build, then run.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
DEMO_MODEL ?= models/gpt-oss-120b.json
GPU_BUILD_DIR ?= build-gpu
# The virtual environment of the Python package and its tests (scripts/python-env.sh).
PYTHON := $(CURDIR)/.venv/bin/python

.PHONY: all deps venv configure build python demo test test-matrix bench fuzz sanitize gpu-bundle clean format

all: build

deps:
	./scripts/install-deps.sh

venv: deps
	./scripts/python-env.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DDBUF_PYTHON=$(PYTHON) $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The Python package, built and installed into .venv the way a user installs
# it (pip install ./python), incrementally in $(BUILD_DIR)/python.
python: venv
	$(PYTHON) -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q ./python \
	  -Cbuild-dir=$(abspath $(BUILD_DIR))/python

demo: build python
	./scripts/demo.sh $(BUILD_DIR) $(DEMO_MODEL)
	./scripts/demo_daemon.sh $(BUILD_DIR)
	./scripts/demo_python.sh $(BUILD_DIR) $(PYTHON)

test: build python
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) -LE trainers_matrix

# The whole matrix of python/tests/test_trainers.py (make test runs a pairwise-covering subset).
test-matrix: build python
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L trainers_matrix

# Hardening (docs/reliability.md), each in a tree of its own: every libFuzzer
# harness for FUZZ_SECONDS, and the suite under ASan + UBSan and under TSan.
FUZZ_SECONDS ?= 60
fuzz: deps
	./scripts/fuzz.sh $(FUZZ_SECONDS)

sanitize: deps
	./scripts/sanitize.sh address,undefined
	./scripts/sanitize.sh thread

bench: build python
	./scripts/bench.sh $(BUILD_DIR) $(PYTHON)

# A CUDA build of its own (build-gpu/) packed into gpu-bundle/ (~8 MB: run unpacks its payload): copy that folder
# to a machine with an NVIDIA GPU and run `gpu-bundle/run [RESULTS_DIR]` there
# (gpu-bundle/README.txt).
gpu-bundle: deps venv
	cmake -S . -B $(GPU_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DDBUF_CUDA=ON $(CMAKE_FLAGS)
	cmake --build $(GPU_BUILD_DIR) -j $(JOBS)
	rm -rf $(GPU_BUILD_DIR)/python-package
	DBUF_CUDA=ON $(PYTHON) -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q ./python \
	  -Cbuild-dir=$(abspath $(GPU_BUILD_DIR))/python --target $(abspath $(GPU_BUILD_DIR))/python-package
	./scripts/make_gpu_bundle.sh $(GPU_BUILD_DIR) gpu-bundle

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp')

clean:
	rm -rf $(BUILD_DIR)
