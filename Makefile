# The two commands an operator needs:
#   make run    build everything, then start Redis, the sidecar, Envoy with the filter and a demo
#               upstream: EXAMPLE=api-key (the default), jwt, llm, rlqs or native (README, "The examples")
#   make test   install what is missing, build, and run every test (unit, wasm32, Redis, Envoy end to
#               end, and the compose files started in containers: compose-test below)
# Both install what is missing first (scripts/install-deps.sh: redis-server, wasm targets,
# wasm-bindgen-test-runner, promtool, the pinned Envoy in .venv; `make test` also
# scripts/install-container-deps.sh: docker.io, debootstrap, Docker Compose v2 in .venv).

CARGO        ?= cargo
WASM         := target/wasm32-wasip1/release/ratelimit_filter.wasm
SIDECAR      := target/release/ratelimit-sidecar
REBALANCER   := target/release/ratelimit-rebalancer
export ENVOY_BIN ?= $(CURDIR)/.venv/bin/envoy

.PHONY: all deps build test test-native test-wasm run bench reliability chaos chaos-bites simulate lint fmt clean

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --release -p ratelimit-sidecar -p ratelimit-rebalancer
	$(CARGO) build --release -p ratelimit-filter --target wasm32-wasip1
	@ls -l $(WASM) $(SIDECAR) $(REBALANCER)

test: build test-native test-wasm compose-test

# Unit tests, a short pass of every fuzz target (docs/fuzzing.md), the sidecar against real Redis
# (single, Cluster), and the end-to-end tests with real Envoy, sidecar, Redis and upstream. The
# e2e tests use the release artifacts built above.
test-native:
	RATELIMIT_SIDECAR_BIN=$(CURDIR)/$(SIDECAR) RATELIMIT_FILTER_WASM=$(CURDIR)/$(WASM) RATELIMIT_REBALANCER_BIN=$(CURDIR)/$(REBALANCER) \
		$(CARGO) test --workspace --no-fail-fast

# The filter's pure logic (and the wire types) again, compiled to wasm32 and run under Node.
test-wasm:
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
		$(CARGO) test -p ratelimit-filter --target wasm32-unknown-unknown --lib

# EXAMPLE, ENVOY_CONFIG, LIMITS and REDIS_URL reach the script from make's command line or the
# environment.
run: build
	scripts/run-local.sh

bench: build
	$(CARGO) build --release -p ratelimit-noop-filter --target wasm32-wasip1
	RATELIMIT_SIDECAR_BIN=$(CURDIR)/$(SIDECAR) RATELIMIT_FILTER_WASM=$(CURDIR)/$(WASM) \
		$(CARGO) run --release -p ratelimit-e2e --bin ratelimit-bench -- $(BENCH_ARGS)

# Failure behaviour, measured (docs/failure-behaviour.md): real processes on loopback broken on
# purpose (Redis slow, down, failing over; lost replies; a sidecar killed; floods), one table.
# RELIABILITY_ARGS="--seconds 5 --scenario 3,4" etc.
reliability: build
	RATELIMIT_SIDECAR_BIN=$(CURDIR)/$(SIDECAR) RATELIMIT_FILTER_WASM=$(CURDIR)/$(WASM) \
		$(CARGO) run --release -p ratelimit-e2e --bin ratelimit-reliability -- $(RELIABILITY_ARGS)

# Exactness checked by exploration (docs/failure-behaviour.md, "Measured under generated faults"):
# seeds draw workloads, faults and reloads over real processes; a checker holds what the upstream
# received against the bucket model. CHAOS_ARGS="--minutes 120" runs seeds for two hours;
# "--seed 7" replays one (and shrinks it if it violates). A 90 s run is part of `make test`.
CHAOS_ARGS ?= --seeds 3
chaos: build
	RATELIMIT_SIDECAR_BIN=$(CURDIR)/$(SIDECAR) RATELIMIT_FILTER_WASM=$(CURDIR)/$(WASM) \
		$(CARGO) run --release -p ratelimit-e2e --bin ratelimit-chaos -- $(CHAOS_ARGS)

# Shows that make chaos bites (docs/failure-behaviour.md, "What it finds"): each fix of
# tests/bites/ reverted in a worktree of its own, and chaos run from seed 1 until it violates.
# About 2 to 15 minutes per fix (shrinking included). BITES=settle-bytes,... picks some.
chaos-bites: build
	$(CARGO) build --release -p ratelimit-e2e --bin ratelimit-chaos
	BITES="$(BITES)" scripts/chaos-bites.sh

# The shard model (docs/scaling.md): the decision path over a Redis Cluster of 1, 2 and 3
# primaries (uniform and Zipf keys), a hot key with and without leases, the latency a network hop
# adds (network namespaces: needs root), and the model for 1M decisions/s from the run's own
# figures; part 5, Redis held at the model's utilisation. Not part of `make test`; about 7 minutes. SCALE_ARGS="--seconds 4 --parts 1,2" etc.
.PHONY: script-instructions
# Redis's instructions per call of the bucket scripts under callgrind (docs/benchmarks.md).
script-instructions:
	command -v valgrind >/dev/null || apt-get install -y valgrind
	scripts/script-instructions.py

.PHONY: scale
scale: build
	RATELIMIT_SIDECAR_BIN=$(CURDIR)/$(SIDECAR) RATELIMIT_FILTER_WASM=$(CURDIR)/$(WASM) \
		$(CARGO) run --release -p ratelimit-e2e --bin ratelimit-scale -- $(SCALE_ARGS)

# The regional-quota simulation (docs/regions.md): every scenario, static and rebalanced shares,
# one table. Pure computation, a second or so in release mode; SIM_ARGS="--seed 2" etc.
simulate:
	$(CARGO) run --release -p ratelimit-regions --bin ratelimit-regions-sim -- $(SIM_ARGS)

# The filter as a Wasm OCI image for Istio's WasmPlugin (the "compat" variant: one tar+gzip layer
# holding plugin.wasm), written as an OCI image layout under target/oci/ without a container
# engine. Prints the manifest digest to pin (WasmPlugin `sha256`) and how to push the layout
# without changing it (oras cp --from-oci-layout, skopeo copy --preserve-digests, crane push).
# OCI_REPOSITORY names your registry's repository in the push commands it prints.
OCI_TAG ?= 0.1.0
OCI_REPOSITORY ?= ghcr.io/example/ratelimit-filter
.PHONY: oci
oci: deps
	$(CARGO) build --release -p ratelimit-filter --target wasm32-wasip1
	$(CARGO) run -q -p ratelimit-e2e --bin wasm-oci -- --wasm $(WASM) --out target/oci/ratelimit-filter --tag $(OCI_TAG) --repository $(OCI_REPOSITORY)

# Kubernetes without a mesh (docs/kubernetes.md): envoy/kubernetes/ with the images you pushed,
# written to KUBERNETES_OUT for `kubectl apply -f`. SIDECAR_IMAGE and FILTER_IMAGE (required),
# ENVOY_IMAGE and REDIS_IMAGE come from make's command line or the environment.
KUBERNETES_OUT ?= target/kubernetes
.PHONY: kubernetes
kubernetes:
	scripts/kubernetes.sh $(KUBERNETES_OUT)

# Fuzzing (docs/fuzzing.md): every parser an outsider's bytes reach, as proptest targets in
# filter/tests/fuzz.rs and sidecar/tests/fuzz.rs. `make test` runs each one briefly (its default
# case count); `make fuzz` runs FUZZ_CASES inputs per target (70,000 x 16 targets: over 1,000,000
# in all) in release mode, then prints what the tests counted: per target and in total, the
# inputs tried and the panics found. FUZZ_SEED=<seed of a line> replays a run.
FUZZ_CASES   ?= 70000
FUZZ_SUMMARY := target/fuzz-summary.txt
.PHONY: fuzz
fuzz:
	@mkdir -p target && rm -f $(FUZZ_SUMMARY)
	@FUZZ_CASES=$(FUZZ_CASES) FUZZ_SUMMARY=$(CURDIR)/$(FUZZ_SUMMARY) \
		$(CARGO) test --release --no-fail-fast -p ratelimit-filter -p ratelimit-sidecar --test fuzz; \
	status=$$?; \
	echo; echo "fuzz summary ($$(nproc) cores, release build):"; \
	sort -k2 $(FUZZ_SUMMARY); \
	awk '{ for (i = 1; i < NF; i++) { if ($$i == "inputs") n += $$(i + 1); if ($$i == "panics") p += $$(i + 1); \
	       if ($$i == "failed") f += $$(i + 1) }; t++ } \
	     END { printf "fuzz %-24s inputs %8d  panics %d  failed %d  (%d targets)\n", "TOTAL", n, p, f, t }' \
	     $(FUZZ_SUMMARY); \
	exit $$status

# Containers: the compose files under envoy/ started for real (README, "Docker Compose").
#   make images         every image they need, built offline (scripts/build-images.sh: a Debian
#                       root filesystem from debootstrap, cached under target/images/)
#   make compose-test   the images, then the compose tests (the README's container steps in
#                       tests/tests/docs_commands.rs, tests/tests/compose_*.rs; #[ignore]d in a
#                       plain cargo test), one at a time: they publish the files' fixed ports
# Both install what is missing first (scripts/install-container-deps.sh: docker.io, debootstrap,
# Docker Compose v2 from PyPI into .venv), and start a Docker daemon when none runs, stopping it
# again when done (scripts/dockerd.sh).
COMPOSE_TESTS := --test docs_commands --test compose_stack --test compose_distributed
.PHONY: container-deps images compose-test
container-deps: deps
	@scripts/install-container-deps.sh

images: build container-deps
	scripts/dockerd.sh run scripts/build-images.sh

compose-test: build container-deps
	scripts/dockerd.sh run sh -c 'scripts/build-images.sh && \
		$(CARGO) test -p ratelimit-e2e $(COMPOSE_TESTS) -- --ignored --test-threads=1 --nocapture'

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p ratelimit-filter --target wasm32-wasip1 -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
