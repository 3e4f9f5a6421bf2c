# sandstream: local stack, lint and tests. Everything runs against the real stack
# (Kafka KRaft broker, PostgreSQL 15, Podman API) that `make stack` starts; see README.md.

PY := .venv/bin/python

.PHONY: setup stack up down prune lint test bench bench-peer soak chaos k8s k8s-node k8s-down conformance screenshots image helm criu deploy-test

setup:  ## install Debian packages and the virtualenv (idempotent)
	bash compose/bootstrap.sh

stack: setup  ## start Kafka, PostgreSQL and the Podman service (idempotent)
	$(PY) -m services.localstack up

up: setup  ## the whole system: stack plus sandstream's own services
	.venv/bin/sandstream up

down:  ## stop what `make stack` and `make k8s` started
	$(PY) -m services.localstack.kubernetes down
	$(PY) -m services.localstack down

prune:  ## remove the isolated test environments whose process was killed (topics, ACLs, schema)
	$(PY) -m services.localstack prune

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

test: stack k8s-node helm lint
	.venv/bin/pytest -q -n 3 --dist loadfile --durations=15

bench: stack k8s
	$(PY) -m services.bench

# sandstream beside kubernetes-sigs/agent-sandbox and bare Pods (docs/benchmarks.md): starts a
# Kubernetes cluster of its own (the binaries `make k8s` builds), builds agent-sandbox's
# controller on its first run (~4.5 minutes of CPU, cached beside the cluster's binaries).
# PEER_ARGS=--quick for a short form.
PEER_ARGS ?=
bench-peer: stack
	$(PY) -m services.localstack.kubernetes build
	$(PY) -m services.localstack.agent_sandbox build
	$(PY) -m services.bench peer $(PEER_ARGS)

soak: stack
	.venv/bin/pytest -q -m soak

# The chart's Deployments under podman kube play, the chart installed on the local cluster's real
# node, and the compose file under podman-compose, from the image, each with a sandbox round trip
# (minutes each: outside `make test`; CI runs them).
deploy-test: stack k8s-node helm image
	.venv/bin/pytest -q -m deploy

# The fault-injection checker, long form (docs/reliability.md); the suite runs a short one.
# It starts a private Kafka cluster and PostgreSQL of its own; the stack is not needed.
CHAOS_ARGS ?= --seed 2 --sandboxes 300 --podman 4 --duration 240
chaos: setup
	$(PY) -m services.chaos $(CHAOS_ARGS)

# -- Kubernetes: a real kube-apiserver with kwok as the node (services/localstack/kubernetes.py).
# The first run builds it from the Go module proxy (~10 minutes of two cores); the binaries and
# Go caches stay in ~/.cache/sandstream/kubernetes, so later runs start in seconds.
k8s: setup  ## build what is missing and start the local Kubernetes cluster (idempotent)
	$(PY) -m services.localstack.kubernetes up

# The cluster plus a real node (services/localstack/kube_node.py): a kubelet built with the
# control plane (+~2 minutes on a first build), Debian's containerd and runc; its Pods run real
# containers of images imported from Podman. kwok's node stays; the real one is tainted.
k8s-node: setup  ## `make k8s` plus a real node (kubelet, containerd, runc) (idempotent)
	$(PY) -m services.localstack.kubernetes up --real-node

k8s-down:  ## stop the local Kubernetes cluster (and its real node)
	$(PY) -m services.localstack.kubernetes down

# helm v4 for the chart's tests, built from the Go module proxy beside the cluster's binaries.
helm: setup  ## build helm if missing (a few minutes the first time)
	$(PY) -m services.localstack.helm_build

# CRIU 4.1 from Debian trixie's source package, for checkpoints (`make stack` builds it too).
criu: setup  ## build CRIU if missing (about a minute the first time)
	$(PY) -m services.localstack.criu_build

# -- sandstream's OCI image (services/localstack/image.py, deploy/image/Containerfile): a Debian
# 12 base by mmdebstrap (built once per recipe), the dependencies' wheels (downloaded once), the
# checkout's wheel; a no-op when nothing changed.
image: setup  ## build localhost/sandstream:<version> into Podman (no registry)
	$(PY) -m services.localstack.image

# OpenShell's conformance runner and CLI (see docs/openshell-compat.md): the shared tools folder
# next to the checkout has builds; OPENSHELL_CONFORMANCE / OPENSHELL_CLI override.
OPENSHELL_CONFORMANCE ?= $(abspath $(wildcard ../shared/tools/openshell/openshell-conformance))
OPENSHELL_CLI ?= $(abspath $(wildcard ../shared/tools/openshell/openshell))
export OPENSHELL_CONFORMANCE OPENSHELL_CLI

screenshots: stack  ## retake docs/img/'s console screenshots (the browser tests, writing there)
	SANDSTREAM_SCREENSHOTS=docs $(PY) -m pytest -q tests/test_console_browser.py

conformance: stack  ## OpenShell's suite twice and its CLI against a `sandstream up` of their own
	$(PY) -m services.openshell.conformance --runs 2
	$(PY) -m services.openshell.conformance --cli
