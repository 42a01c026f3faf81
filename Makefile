# `make demo` and `make test` each create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Converted model weights (SmolLM2's GGUF to fp32, its q4 formats) go to the
# machine's shared cache, ~/.cache/compushare unless $COMPUSHARE_CACHE says otherwise:
# converted once per machine, for every clone's tests, demos and nodes.
DEMO_HOME := $(CURDIR)/demo-swarm

.PHONY: demo test test-fast lint bench sysdeps testsysdeps netlabdeps clean

sysdeps:
	@# libp2p builds fastecdsa from source: it needs a compiler and GMP headers.
	@if ! dpkg -s libgmp-dev >/dev/null 2>&1 || ! command -v gcc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq build-essential libgmp-dev; \
	  else echo "please install build-essential and libgmp-dev"; fi; fi

testsysdeps:
	@# The dashboard test drives Chromium; the tray test needs an X server and a tray host.
	@if ! command -v chromium >/dev/null || ! command -v Xvfb >/dev/null || ! command -v trayer >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium xvfb trayer; \
	  else echo "please install chromium, xvfb and trayer"; fi; fi

# tools/netlab (network namespaces: WAN delay, rate limits, NAT routers) needs root,
# iproute2/iptables/ethtool/ping, and netfilterqueue where the kernel has no netem.
NETLAB_APT := iproute2 iptables ethtool iputils-ping libnetfilter-queue-dev
netlabdeps: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then \
	  if ! command -v iptables >/dev/null || ! command -v ethtool >/dev/null || ! command -v ping >/dev/null \
	     || ! dpkg -s libnetfilter-queue-dev >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(NETLAB_APT); fi; \
	  $(PY) -c 'import netfilterqueue' 2>/dev/null || $(PY) -m pip install -q -e '.[netlab]'; \
	else echo "tools/netlab needs root: its tests will be skipped"; fi

$(STAMP): pyproject.toml | sysdeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy==2.4.6
	@# ggml-python built for this CPU, once per machine (its wheel cached by CPU): tools/install_ggml.py
	$(PY) tools/install_ggml.py
	$(PY) -m pip install -q -e '.[test,tray]'
	touch $(STAMP)

# Tests marked serial bound or compare timings: they run first, one at a time, on a
# quiet machine. Then the rest run on TEST_WORKERS processes at once (pytest-xdist):
# an integration test spends much of its time waiting on node processes. Both parts
# always run; either failing fails the target. docs/testing.md: the rules.
TEST_WORKERS ?= 3
test: $(STAMP) testsysdeps netlabdeps lint
	status=0; \
	$(PY) -m pytest -q -ra --durations=5 -m serial || status=$$?; \
	$(PY) -m pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadgroup -m "not serial" || status=$$?; \
	exit $$status

# The developer loop: the import contracts and the unit tests (pure cores, codecs,
# in-memory drivers; no node processes, no network namespaces), about a minute.
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -ra -m unit

# The code's habits (docs/testing.md): import contracts, ruff, mypy on the pure cores
# (pyproject.toml lists them once), and the size limits.
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy $$($(PY) tools/pure_cores.py)
	$(PY) tools/code_size.py --check --top 1

demo: $(STAMP)
	$(VENV)/bin/compushare swarm up --nodes 3 --model smollm2-135m --home $(DEMO_HOME)
	$(VENV)/bin/compushare run --model smollm2-135m --verbose --home $(DEMO_HOME)/client \
	  --swarm-home $(DEMO_HOME) "What is the capital of France?" \
	  && $(VENV)/bin/compushare status --home $(DEMO_HOME)/client --swarm-home $(DEMO_HOME); \
	status=$$?; $(VENV)/bin/compushare swarm down --home $(DEMO_HOME); exit $$status

bench: $(STAMP)
	$(PY) bench/node_compute.py
	$(PY) bench/pipeline_overhead.py
	$(PY) bench/pipeline_overhead.py --format q4
	$(PY) bench/compute_beside_loop.py
	$(PY) bench/gossip.py
	$(PY) bench/swarm_fetch.py $(if $(filter 0,$(shell id -u)),--wan,)
	$(PY) bench/failover.py
	$(PY) bench/soak.py --minutes 5
	# 200 light nodes need more than 2 cores (docs/performance.md): 25 and 50 here.
	$(PY) bench/scale.py --first 25 --nodes 50
	$(PY) bench/hostile.py
	$(PY) bench/he.py
	$(PY) bench/batch_invariance.py
	$(PY) bench/finetune.py
	$(if $(filter 0,$(shell id -u)),$(PY) bench/wan.py,@echo "bench/wan.py needs root (network namespaces): skipped")
	$(if $(filter 0,$(shell id -u)),$(PY) bench/nat.py,@echo "bench/nat.py needs root (network namespaces): skipped")

clean:
	rm -rf $(VENV) .cache demo-swarm
