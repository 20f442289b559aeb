# Thin wrapper over CMake. `make run` and `make test` install what is missing first.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps build run test sanitize bench install examples clean gpu-debs gpu-check
all: build

deps:
	@sh scripts/install-deps

$(BUILD)/Makefile: CMakeLists.txt
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: deps $(BUILD)/Makefile
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/fsdprun -n 2 recipes/gpt_fortunes.lua

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The whole suite under AddressSanitizer and UBSan (findings fail the test), in build-asan/
# (docs/ARCHITECTURE.md "Tests").
sanitize:
	$(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DFSDP_CUDA=OFF -DFSDP_SANITIZE=ON $(CMAKE_FLAGS)"

bench: build
	sh bench/run.sh $(BUILD)

PREFIX ?= /usr/local
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

examples: build
	cmake --build $(BUILD) --target examples

# The one-command GPU check (docs/cuda.md): gpu-debs here, where apt's registry is reachable;
# gpu-check on the GPU machine (results in $$OUT, else gpu-check-out/).
gpu-debs:
	bash scripts/gpu-check --fetch

gpu-check:
	bash scripts/gpu-check

clean:
	rm -rf $(BUILD) build-asan
