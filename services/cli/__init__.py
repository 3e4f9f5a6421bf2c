"""The ``sandstream`` command (typer): ``main`` is the root, one module per command group
(``sandbox``, ``tokens``, ``operations``), ``client`` talks to the HTTP API and ``render``
prints for people (tables) and scripts (``-o json``). Imports services.common, services.api
(tokens), services.processor (rebuild) and services.up (``up``/``down``).
"""
