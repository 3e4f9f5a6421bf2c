"""The HTTP API: ``app.create_app`` assembles one router per resource (``routes/``), with the
dependencies (``deps``: tokens and scopes, shared state), errors and handlers declared once.
Commands go to Kafka through ``gateway``; reads come from ``readmodel`` (PostgreSQL); nothing
here calls a driver. ``auth`` holds the token store. Imports services.common only.
"""
