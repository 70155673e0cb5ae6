# Thin wrapper over CMake. `make demo` and `make test` work on a fresh machine
# as root: they install what is missing, configure, build, then run.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
DEMO_MODEL ?= models/gpt-oss-120b.json
GPU_BUILD_DIR ?= build-gpu

.PHONY: all deps configure build demo test bench gpu-bundle clean format

all: build

deps:
	./scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

demo: build
	./scripts/demo.sh $(BUILD_DIR) $(DEMO_MODEL)
	./scripts/demo_daemon.sh $(BUILD_DIR)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

bench: build
	./scripts/bench.sh $(BUILD_DIR)

# A CUDA build of its own (build-gpu/) packed into gpu-bundle/: copy that folder
# to a machine with an NVIDIA GPU and run `gpu-bundle/run [RESULTS_DIR]` there
# (gpu-bundle/README.txt).
gpu-bundle: deps
	cmake -S . -B $(GPU_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DDBUF_CUDA=ON $(CMAKE_FLAGS)
	cmake --build $(GPU_BUILD_DIR) -j $(JOBS)
	./scripts/make_gpu_bundle.sh $(GPU_BUILD_DIR) gpu-bundle

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp')

clean:
	rm -rf $(BUILD_DIR)
