# The two main jobs, from a fresh clone:
#   make render            set everything up and render the dev stack offline (STACK=prod for prod)
#   make test              set everything up and run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STACK ?= dev
APT_PACKAGES := $(shell grep -hv '^\s*\#' bpf/apt-packages.txt components/router/apt-packages.txt 2>/dev/null)

.PHONY: render test deps apt-deps bench policy-check golden clean
.DELETE_ON_ERROR:

$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	touch $@

deps: $(VENV)/.installed

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
test: deps apt-deps
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 0; fi; exit $$rc

# Regenerate tests/golden/<stack>.json after an intended change to what a stack renders.
golden: deps
	$(PY) -m tools.golden --write

policy-check: deps
	$(PY) -m tools.policy_check $(STACK)

bench: deps apt-deps
	$(PY) bench/ebpf_sockmap_bench.py
	$(PY) bench/router_bench.py

clean:
	rm -rf out bpf/build .pytest_cache
