"""The ``sandstream`` command (typer): ``main`` is the root, one module per command group
(``sandbox``, ``tokens``, ``operations``), ``client`` talks to the HTTP API and ``render``
prints for people (tables) and scripts (``-o json``). Imports services.common, services.api
(tokens), services.processor (rebuild) and services.up (``up``/``down``).

Modules:

- ``audit``: `sandstream audit verify | chain | at | explain | export | rebuild | diff | promote`.
- ``client``: the CLI's client of the HTTP API (errors, retries, exit codes).
- ``create``: `sandstream sandbox create` (from a spec or a template).
- ``exec``: `sandstream sandbox exec`.
- ``files``: `sandstream sandbox cp` and `sandstream sandbox files ls | stat | mkdir | rm | mv`.
- ``lifecycle``: `sandstream sandbox hold | release | extend`.
- ``lifecycle_options``: the operator-lifecycle parts of `sandstream sandbox create` and `get`.
- ``log``: `sandstream log ...`.
- ``main``: the `sandstream` command.
- ``operations``: `sandstream status | up | down | rebuild`.
- ``pools``: `sandstream pool ...`.
- ``processor``: `sandstream processor [run]`.
- ``providers``: `sandstream provider ...`, `sandstream sandbox attach|detach` and `sandstream
  provider-sync`.
- ``render``: output for people and scripts.
- ``roles``: `sandstream processor | executor | watcher | scheduler | api`.
- ``sandbox``: `sandstream sandbox ...`.
- ``templates``: `sandstream template create | get | list | update | delete`.
- ``tokens``: `sandstream token ...`.
"""
