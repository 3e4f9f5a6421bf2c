"""sandstream's running roles and its tools, one package per role. Each may import the lower
layers (events, projections, drivers) and, of services/, only what this list names:

- ``common``: settings, metrics, the PostgreSQL pool, migrations, task supervision, the process
  entry point, the Kafka principal of each role and its clients' options. Imports nothing else
  of services/.
- ``processor``: the lifecycle processor, one module per stage (intake, read, plan, write,
  publish, ownership, deciding ahead) and the run loop that wires them; row cache, rebuild.
  Imports common.
- ``executor``: intents to driver calls, the driver watcher, the reconcile loop, drivers built
  from the settings. Imports common.
- ``audit``: the audit tools (re-deciding the log to verify the record, the history's hash
  chains, time travel, explain, export). Imports common, processor.
- ``scheduler``: brings time into the log: publishes DeadlineDue when a deadline or expiry
  recorded in a row falls due. Imports common.
- ``api``: the HTTP API (app assembly, one router per resource, auth, read-model queries)
  and the provider service its routes and the provider-sync controller share. Imports common,
  audit, and executor for its log and exec sources only (``executor.log_sources``,
  ``executor.exec_sources``: a sandbox's output is read from its runtime, never stored, and
  exec runs a command through the driver's exec capability; the API makes no lifecycle call).
- ``provider_sync``: the provider-sync controller and its sources (a directory, Kubernetes
  Secrets). Imports common, api.
- ``localstack``: the local stack (Kafka, PostgreSQL, Podman) and isolated test environments.
  Imports common.
- ``openshell``: the OpenShell-compatible gRPC API (a second door beside the HTTP API), its
  protos, and the runners of OpenShell's conformance suite and CLI. Imports common, api,
  executor, localstack.
- ``up``: the one-process local default (control plane + API; ``up``/``down``). Imports
  common, processor, executor, scheduler, api, provider_sync, localstack, openshell.
- ``roles``: the roles as separate long-lived processes (``sandstream processor``,
  ``executor``, ``watcher``, ``scheduler``, ``api``, ``provider-sync``; ``prepare``), each with
  its health endpoint. Imports common, processor, executor, scheduler, api, provider_sync, and
  localstack (``prepare`` creates the topics as the local stack does).
- ``cli``: the ``sandstream`` command, one module per command group. Imports common, api,
  provider_sync, processor, up, audit, roles.
- ``bench``: the benchmarks. Imports common, processor, executor, api, up, localstack.
- ``chaos``: the fault-injection checker (``make chaos``): starts processor, executor and
  watcher processes and a private cluster (localstack), serves the API in its own process,
  reconciles and lists the backend through the executor's drivers, and ends with the audit and
  rebuild tools. Imports common, processor, executor, audit, api, localstack.

``tests/test_house.py`` holds the same table and fails when an import breaks it.
"""
