# gpufrac — every target sets itself up: venv, install, native build, protos.
# The agent runs on Python 3.10+, but the demo and the tests use kmock (the
# apiserver emulator), which needs 3.11+: python3 if it is new enough, else the
# first python3.1x on PATH that is.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(firstword $(foreach p,python3 python3.11 python3.12 python3.13 python3.14,\
  $(shell $(p) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo $(p))))
endif
VENV   := .venv
PY     := $(VENV)/bin/python
CC     ?= cc

BUILD      := build/native
ASAN_BUILD := build/asan
CSTD       := -std=c11 -D_GNU_SOURCE -fPIC -pthread -Wall -Wextra -Werror
CFLAGS_REL := $(CSTD) -O2 -g
CFLAGS_SAN := $(CSTD) -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
LDLIBS     := -ldl -lpthread

SIM_SRC := gpufrac/simgpu/native
MG_SRC  := gpufrac/memguard/native
SIM_HDR := $(wildcard $(SIM_SRC)/*.h)
# The fake libcuda is split by area: cuda.c (core, symbol table), cuda_*.c (the rest).
CUDA_SRC := $(sort $(wildcard $(SIM_SRC)/cuda*.c))
MG_HDR  := $(wildcard $(MG_SRC)/*.h)
# libmemguard.so: memguard.c and every mg_*.c but the test program mg_ctest.c.
MG_LIB_SRC := $(MG_SRC)/memguard.c $(sort $(filter-out $(MG_SRC)/mg_ctest.c,$(wildcard $(MG_SRC)/mg_*.c)))

NATIVE_LIBS = libnvidia-ml.so.1 libcuda.so.1 libmemguard.so mg_ctest

.PHONY: all setup native native-asan proto run test test-fast bench lint clean tools

all: setup

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: make run/test need Python 3.11 or newer on PATH" \
	  "(python3.11, python3.12, ... or python3); the demo's apiserver emulator, kmock, needs it." \
	  "Or name one: make PYTHON=/path/to/python3.12 test" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed native proto

native: $(addprefix $(BUILD)/,$(NATIVE_LIBS))
native-asan: $(addprefix $(ASAN_BUILD)/,$(NATIVE_LIBS))

# One rule set, two flavours: release in build/native, ASan+UBSan in build/asan.
# -Bsymbolic: like the real drivers, the fakes' calls between their own API
# functions stay inside the library (an LD_PRELOAD shim sees only the app's calls).
define native_rules
$(1)/libnvidia-ml.so.1: $(SIM_SRC)/nvml.c $(SIM_SRC)/simstate.c $(SIM_HDR)
	@mkdir -p $(1)
	$(CC) $(2) -shared -Wl,-soname,libnvidia-ml.so.1 -Wl,-Bsymbolic -o $$@ $(SIM_SRC)/nvml.c $(SIM_SRC)/simstate.c $(LDLIBS)
$(1)/libcuda.so.1: $(CUDA_SRC) $(SIM_SRC)/simstate.c $(SIM_HDR)
	@mkdir -p $(1)
	$(CC) $(2) -shared -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic -o $$@ $(CUDA_SRC) $(SIM_SRC)/simstate.c $(LDLIBS)
$(1)/libmemguard.so: $(MG_LIB_SRC) $(MG_HDR)
	@mkdir -p $(1)
	$(CC) $(2) -shared -o $$@ $(MG_LIB_SRC) $(LDLIBS)
$(1)/mg_ctest: $(MG_SRC)/mg_ctest.c $(MG_HDR) $(SIM_SRC)/cuda_abi.h $(1)/libcuda.so.1
	@mkdir -p $(1)
	$(CC) $(2) -I$(SIM_SRC) -o $$@ $(MG_SRC)/mg_ctest.c -L$(1) -l:libcuda.so.1 -Wl,-rpath,'$$$$ORIGIN' $(LDLIBS)
endef
$(eval $(call native_rules,$(BUILD),$(CFLAGS_REL)))
$(eval $(call native_rules,$(ASAN_BUILD),$(CFLAGS_SAN)))

PROTOS := $(wildcard gpufrac/proto/*.proto)
PROTO_STAMP := gpufrac/proto/.generated
proto: $(PROTO_STAMP)
$(PROTO_STAMP): $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

# The main job: the agent on a real node when a GPU and a kubelet are present,
# otherwise on a simulated GPU node with a short demo.
run: setup
	$(VENV)/bin/gpufrac run

# Command-line tools the tests use besides the venv: kubectl (tests/integration/
# test_deploy_manifests.py runs `kubectl kustomize`) and promtool (tests/integration/
# test_metrics.py runs `promtool check metrics`). An existing one is kept; otherwise
# its Debian package is installed when we are root. $(call need_tool,COMMAND,PACKAGE)
define need_tool
	@command -v $(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(1) (Debian package $(2))"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	  fi; \
	  command -v $(1) >/dev/null 2>&1 || { \
	    echo "error: $(1) is missing and could not be installed (needs root and apt-get);" \
	         "install $(1) (Debian: apt-get install $(2)) and re-run" >&2; exit 1; }; }
endef

tools:
	$(call need_tool,kubectl,kubernetes-client)
	$(call need_tool,promtool,prometheus)

test: setup native-asan tools
	$(PY) -m pytest -q -p no:cacheprovider tests

test-fast: setup tools
	$(PY) -m pytest -q -x -p no:cacheprovider tests -m 'not slow'

bench: setup
	$(PY) -m bench

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf build $(VENV) gpufrac/proto/*_pb2*.py* $(PROTO_STAMP)
