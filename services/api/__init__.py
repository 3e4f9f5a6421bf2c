"""The HTTP API: commands go to Kafka through ``gateway``; reads come from ``readmodel``
(PostgreSQL); nothing here calls a driver (logs and files are read and written through
the backend's sources, never a lifecycle call). Imports services.common and services.audit.

- ``app``: ``create_app`` assembles one router per resource with its dependencies and handlers.
- ``routes/``: one router per resource (commands, sandboxes, history, watch, providers, audit,
  lifecycle, operations).
- ``readmodel/``: the reads: views, pages, queries, outcomes, the change horizon, both feeds,
  the attention counts, the phase trend (its docstring lists its modules).
- ``console/``: the operator's web console under ``/ui/`` (its docstring lists its modules).
- ``deps``: the bearer-token check with its scope, and the shared state (pool, feed, gateway).
- ``guard``: the front gate: authentication and the body size limit before any parsing.
- ``gateway``: commands in: publish once, answer retries with the first outcome, wait for it.
- ``idempotency``: what the API remembers of each command id it took in.
- ``models``: request and response bodies that are not read-model views; shared declarations.
- ``files_models``: the bodies, path parameter and error answers of the files routes.
- ``errors``, ``handlers``: the JSON errors and the exception handlers that answer with them.
- ``middleware``: request metrics by route template.
- ``probe``: the readiness probe of Kafka (the input topics' end offsets, the log's identity).
- ``server``: serving the app with uvicorn in the embedding process's loop, TLS when given.
- ``openapi_export``: docs/openapi.json, checked in and compared by a test.
- ``providers``: the provider service, the one place provider writes are decided (updates and
  their receipts, attach, detach, delete) for every door and the provider-sync controller
  (services/provider_sync/).
- ``claims``: a claim adopts a warm pool's Ready member under the claimant's name, or says why
  it is cold (docs/adr/0009).
- ``pool_claims``: the claim path of a create naming a template with a warm pool: adopt a
  member or create cold, say which and why, count it for the pool's status.
- ``wake``: wake on access: an exec or file call resumes a Suspended sandbox, waits for Ready.
- ``provider_outbox``: the commands a provider change owes sandboxes, stored with the change
  until Kafka acknowledges them (docs/adr/0005).
"""
