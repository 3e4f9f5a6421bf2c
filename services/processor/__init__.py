"""The lifecycle processor: consumes the input topics, folds each batch with the pure lifecycle
rules (projections/), writes rows, history, outcomes, outbox and offsets in one statement, and
publishes the outbox (its events, dead letters and chain checkpoints: ``checkpoints``); also
the row cache and the rebuild from the log.

``python -m services.processor`` runs one. Imports services.common only.
"""
