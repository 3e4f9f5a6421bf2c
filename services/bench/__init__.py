"""The benchmarks (``python -m services.bench``, ``make bench``): figures are printed, never
asserted. Tools for people measuring sandstream locally; imports whatever it measures.

Modules:

- ``api_rate``: creates offered to ``sandstream up`` (fake driver) at rising rates, from the
  peer bench's client and from aiohttp, beside ``/healthz`` and Kafka's own produce, with where
  each create's time goes in the API.
- ``ceiling``: a minimal exactly-once projector, the reference the processor is measured against.
- ``claim``: a warm claim at low load, step by step in the process, beside a row-only
  command's decided outcome through the same API and Kafka's own round trip.
- ``cpu``: CPU seconds spent per input, beside the wall-clock rates.
- ``decided``: request → decided outcome at low load through the HTTP API, beside Kafka's and
  PostgreSQL's own round trips.
- ``create_steps``: where a create's time goes at a steady low rate, step by step from its
  history, beside bare Pods (the burst's set-up).
- ``drained``: one observer timing every drain (the processor's, the same-work ceiling's)
  from the first commit until all is committed and published.
- ``drivers``: driver benchmarks (part of ``make bench``).
- ``exec_marks``: an exec's steps marked in the process (the route's functions, the Podman
  driver's exec steps), for ``exec_route`` and ``warm``.
- ``exec_route``: an exec through the HTTP API on Podman step by step in the process, beside
  the API's exec driver, the runtime path and a bare ``runc exec`` in the same container.
- ``exec_steps``: where an exec's time goes on Podman: the driver's calls, each timed.
- ``fold``: CPU of the decide stage alone.
- ``handoff``: creates one at a time to Ready with the processor's hand-over to the executor
  and without it (two control planes in one process), beside Kafka's own round trip.
- ``idle``: the broker's CPU for an idle control plane on a broker of its own, beside the same
  broker with no client.
- ``idle_use``: what idle suspend costs PostgreSQL at many busy sandboxes (the doors' flush,
  the scheduler's idle scan).
- ``kube``: create, stop and resume latency of the whole pipeline, Podman beside Kubernetes (part
  of ``make bench``).
- ``kube_requests``: the Kubernetes driver's apiserver requests per sandbox beside bare Pods'.
- ``peer_burst``: the peer bench's cold burst for sandstream beside bare Pods alone, with
  sandstream's CPU, Kafka records and PostgreSQL rows per sandbox and its deletes' time.
- ``main``: ``python -m services.bench
  [all|processor|latency|decided|claim|idle|idle-use|scaleout|rebuild|profile|fold|stages|
  drivers|peer|kube-requests|burst|warm|exec|scaling|api-rate|create-steps|handoff]
  [--quick]``.
- ``peer``, ``peer_setup``, ``peer_systems``, ``peer_kube``, ``peer_stats``, ``peer_report``:
  sandstream beside kubernetes-sigs/agent-sandbox and bare Pods on one Kubernetes cluster
  (``make bench-peer``): the phases and the CPU of every process; what a run starts and stops;
  the three systems as the load generator sees them; its Kubernetes client; readiness, latency
  figures and the apiserver's counter; the plan, the lines, the medians, the report and the
  goals.
- ``peer_warm``, ``peer_warm_systems``: the peer benchmark's warm phase: agent-sandbox's warm
  pool beside a sandstream pool (fill, bursts of claims, refill, a sustained claim rate), and
  the two pools as the load generator sees them.
- ``pacing``: requests offered at a steady rate, open loop, at most as many at once as the
  client has connections (the peer bench's sustained phases, ``api_rate``).
- ``processor``: the processor's throughput and latency beside the ceiling and Kafka's own.
- ``profile``: profile of the processor's hot path.
- ``rebuild``: rebuilding the rows from the log: time and memory.
- ``same_work``: the same-work ceiling: exactly the processor's reads and writes, overlapped as
  the processor's, with the least Python.
- ``same_work_drain``: the same-work ceiling's per-poll read, its overlapped drain and its
  measurement.
- ``scaleout``: throughput as processors join the group.
- ``scaling``, ``scaling_stack``, ``steady``: the processor and the executor as 1, 2 and 4
  processes on three brokers of the run's own (what it starts, the partitions each process
  got, the CPU of every party), and creates at a steady rate timed to their rows beside
  Kafka's own latency.
- ``stages``: CPU of the processor's pure stages.
- ``wake``: resume and wake-on-exec (an HTTP exec on a Suspended sandbox → its first output) on
  Podman, without and with memory kept by CRIU (part of ``drivers``).
- ``warm``: a warm claim beside a cold create on Podman, each to an exec's answer.
- ``workload``: the generated log the processor benchmarks drain.
"""
