"""The local stack for people running sandstream on one machine and for the tests: Kafka
(KRaft), PostgreSQL and Podman started idempotently (``python -m services.localstack
up|down|status``), a real Kubernetes control plane with kwok as its node (``python -m
services.localstack.kubernetes up|down|status``), and isolated environments (own topics and
schema) for tests and benchmarks. Not used by the running roles. Imports services.common only.

- ``cli``: ``python -m services.localstack up|down|status|prune``.
- ``stack``: ``up``, ``down`` and ``status`` of the single-broker stack, component by component.
- ``processes``: what the components share: their error and status line, the processes they
  start (pid files, readiness waits, stopping).
- ``kafka_broker``: the single broker (jars, storage, start), the project topics, the roles'
  users and ACLs.
- ``postgres``: the local cluster, our role, database and password, the migrations.
- ``podman_service``: the Podman API service (CRIU first on its PATH) and the sandbox base
  image.
- ``criu_build``: build CRIU 4.1 from Debian trixie's source package (apt), cached beside the
  local cluster's binaries, for checkpoints (a suspend that keeps memory).
- ``config``: pure helpers: file locations, rendered configs, command lines.
- ``kafka_auth``: the brokers' SASL/SCRAM and ACLs, one principal per role.
- ``cluster``, ``cluster_config``: a local KRaft cluster of several nodes (``--brokers N``).
- ``private_broker``: a broker of a test's own, for tests that must lose their broker.
- ``isolation``: isolated environments (own topics, groups, schema) and ``prune``.
- ``kubernetes``, ``kube_build``: the local Kubernetes control plane, and its build.
- ``kube_node``: the local cluster's real node (a kubelet with containerd and runc,
  ``kubernetes up --real-node``).
- ``agent_sandbox``: build kubernetes-sigs/agent-sandbox's controller from the Go module proxy,
  with its CRD and ClusterRole, cached beside the local cluster's binaries (``make bench-peer``).

- ``compose_env``: the variables compose/docker-compose.yml reads, for the local stack (or an
  isolated environment of it).
- ``helm_build``: build ``helm`` (v4) from the Go module proxy, cached beside the local cluster's
  binaries.
- ``image``: build sandstream's OCI image without any container registry (``make image``).
- ``kube_play``: run the Helm chart's rendered Deployments on this machine with ``podman kube
  play``, from the image (`make image`), against the local stack's Kafka and PostgreSQL.
- ``kube_chart``: ``helm install`` of the chart on the local cluster's real node with the
  ``kubernetes`` driver, from the image imported into the node's containerd.
"""
