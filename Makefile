# Transom: `make demo` runs the whole loop on this machine; `make test` runs the test suite.
# Both create the virtual environment in .venv and install what they need on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all deps system-deps demo test test-fast bench clean help

help:
	@echo "make demo   - run the whole loop (broker, agents, TEE, controller, a 4-rank job, an injected XID 79)"
	@echo "make demo SCHEDULER=slurm - the same under a real Slurm cluster on the hosts test bed (root)"
	@echo "make test   - run the test suite (starts the real services its tests need)"
	@echo "make bench  - run the benchmarks in bench/"
	@echo "make clean  - remove the virtual environment and run outputs"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: any other version or an open range pulls several GB of CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,mooncake]'
	touch $(STAMP)

deps: $(STAMP) system-deps

# Debian packages some tests and parts need, as COMMAND:PACKAGE (a package is installed when its
# command is missing): the InfluxDB server (sink and dashboard tests), Chromium (the run report's
# render test), kubectl (`kubectl kustomize` renders deploy/kustomize), openssl (the TLS tests' test
# CA), setpriv (the agent run as nobody), unshare and ip (the hosts test bed), Slurm and munge (the real Slurm
# cluster on the hosts test bed: transom/slurmbed.py), and libibverbs (Mooncake transfer
# engine, a library: checked with ldconfig). tests/test_checkout.py checks that every command a test
# looks up is named here.
TOOLS := influxd:influxdb chromium:chromium kubectl:kubernetes-client openssl:openssl setpriv:util-linux unshare:util-linux ip:iproute2 slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge
system-deps:
	@missing="$$(for t in $(TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || echo $${t#*:}; done | sort -u)"; \
	ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	if [ -n "$$(echo $$missing)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note: install the Debian packages $$missing (needs root)"; fi; \
	fi

# SCHEDULER=slurm: the loop on the hosts test bed under a real Slurm cluster (needs root, slurm-wlm, munge)
SCHEDULER ?= local
demo: deps
	$(VENV)/bin/transom demo --scheduler $(SCHEDULER)

test: deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

test-fast: deps
	$(PY) -m pytest -q -m "not e2e" -p no:cacheprovider

bench: deps
	$(PY) -m pip install -q -e '.[bench]'     # TorchFT, the peer bench/goodput.py compares with
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs *.egg-info
