# The README's two commands: `make quickstart` and `make test`. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
# Debian packages: bubblewrap (isolation), skopeo + umoci (docker:// images; gnupg signs them in tests), docker-registry and
# busybox-static (a real registry and images for tests), gcc + libc6-dev (the static orchard-enter helper and
# the bundle launcher), debootstrap (foreign root filesystems for the agent-bundle tests), binutils (strip),
# charliecloud-runtime, podman + runc (the Slurm backend's charliecloud and podman runtimes), python3 (the
# system Python the non-root pilot test runs as an ordinary user), libfaketime (a real server whose wall clock steps),
# nftables + slirp4netns (the way out of sandboxes with network: nat for root agents, slirp for the others), openssl
# (certificates for the TLS tests).
SYSTEM_PACKAGES := postgresql bubblewrap gdb skopeo umoci gnupg libfaketime docker-registry busybox-static gcc libc6-dev iproute2 git procps util-linux \
	debootstrap dash binutils charliecloud-runtime podman runc python3 nftables slirp4netns openssl
TORCH_VERSION := 2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: quickstart test system-deps venv bench lint clean

quickstart: system-deps venv  ## set up and run the main job on the local backend
	$(VENV)/bin/orchard quickstart
	$(VENV)/bin/orchard pipeline --quick --output runs/quickstart-pipeline

test: system-deps venv  ## set up and run the whole test suite (with a real single-node Slurm)
	bash slurm/dev-cluster.sh up
	$(VENV)/bin/pytest -q
	$(VENV)/bin/pytest -q plugins/orchard-docker/tests  # against Podman's Docker API (started by its fixtures)

system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml plugins/orchard-remote-agent/pyproject.toml plugins/orchard-docker/pyproject.toml backends/orchard-slurm/pyproject.toml backends/orchard-k8s/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)  # the CPU build on disk; an unpinned torch pulls a CUDA one
	$(PIP) install -q -e '.[test,train]' -e plugins/orchard-remote-agent -e 'plugins/orchard-docker[test]' -e backends/orchard-slurm -e 'backends/orchard-k8s[test]'
	touch $@

bench: system-deps venv  ## the figures of docs/benchmarks.md
	$(VENV)/bin/orchard bench sandboxes -n 1000 -m 1 -c 32 --output bench-sandboxes-1000.json

clean:
	rm -rf $(VENV) build *.egg-info
