"""The driver side: the executor turns decided intents into driver calls (serial per sandbox,
concurrent across sandboxes) and reports their results; the watcher forwards the driver's watch
stream; the reconcile loop reports differences between rows and backend. All three only report
observations: the processor decides.

``python -m services.executor`` runs them with the Podman driver. Imports services.common only.
"""
