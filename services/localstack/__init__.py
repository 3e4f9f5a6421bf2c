"""The local stack for people running sandstream on one machine and for the tests: Kafka
(KRaft), PostgreSQL and Podman started idempotently (``python -m services.localstack
up|down|status``), a real Kubernetes control plane with kwok as its node (``python -m
services.localstack.kubernetes up|down|status``), and isolated environments (own topics and
schema) for tests and benchmarks. Not used by the running roles. Imports services.common only.
"""
