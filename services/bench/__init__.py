"""The benchmarks (``python -m services.bench``, ``make bench``): figures are printed, never
asserted. Tools for people measuring sandstream locally; imports whatever it measures.

Modules:

- ``ceiling``: a minimal exactly-once projector, the reference the processor is measured against.
- ``cpu``: CPU seconds spent per input, beside the wall-clock rates.
- ``drivers``: driver benchmarks (part of ``make bench``).
- ``fold``: CPU of the decide stage alone.
- ``kube``: create and stop latency of the whole pipeline, Podman beside Kubernetes (part of ``make
  bench``).
- ``main``: ``python -m services.bench
  [all|processor|latency|scaleout|rebuild|profile|fold|stages|drivers] [--quick]``.
- ``processor``: the processor's throughput and latency beside the ceiling and Kafka's own.
- ``profile``: profile of the processor's hot path.
- ``rebuild``: rebuilding the rows from the log: time and memory.
- ``scaleout``: throughput as processors join the group.
- ``stages``: CPU of the processor's pure stages.
"""
