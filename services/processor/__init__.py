"""The lifecycle processor: folds the input topics with the pure lifecycle rules (projections/)
into rows, history, outcomes and outbox, exactly once, one module per stage:

- ``consumer``: the run loop: pull a poll, process it through the stages, record it with its
  tracking position; rides out a lost PostgreSQL or Kafka (``python -m services.processor``).
- ``intake``: a poll's records parsed and checked (size, schema, key, partition); the input
  topics' partition count.
- ``read``: what a batch is decided on, in one snapshot (offsets, rows, outcomes, chain heads);
  records already applied dropped.
- ``plan``: a batch decided into rows, hash-chained history, outcomes, outbox and offsets
  (pure); the replay the audit tools decide through.
- ``checkpoints``: the newest hash of each history chain a batch wrote, for the outbox to put
  on the checkpoints topic (pure).
- ``write``: the atomic compare-and-set write, decided again on a conflict; poison records
  split out and dead-lettered.
- ``publish``: the outbox handed to the producer in commit order; cursors moved past what is
  acknowledged or set aside (too large to send).
- ``ownership``: assignment, revoke and stopped partitions (the rebalance callbacks).
- ``ahead``: the next poll while a write is in flight: taken, or decided as of that write.
- ``fetch_wait``: how long a fetch waits at the broker: long when idle, short while a
  partition's records are buffered.
- ``failures``: which failure means a lost backend, which a refusal no retry can fix.
- ``row_cache``: the rows last written, used while their partition's offsets stand.
- ``rebuild``: the rows rebuilt from the events topic and compared with the live ones.
- ``gc_thresholds``: the garbage collector's thresholds for the processor's process.

Imports services.common only.
"""
