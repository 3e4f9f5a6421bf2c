"""The HTTP API: ``app.create_app`` assembles one router per resource (``routes/``), with the
dependencies (``deps``: tokens and scopes, shared state), errors and handlers declared once.
Commands go to Kafka through ``gateway``; reads come from ``readmodel`` (PostgreSQL); nothing
here calls a driver. ``auth`` holds the token store. ``providers`` is the provider service
(updates and their receipts, attach, detach, delete) that the routes and the provider-sync
controller (services/provider_sync/) share. Imports services.common only.
"""
