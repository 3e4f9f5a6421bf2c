"""The audit tooling: prove the record is complete and unaltered, and explain it.

- ``entries``: the recorded history (one entry per input with its decision), read in order.
- ``reach``: how far back the input topics still reach (retention) and what that means.
- ``chains``: the hash chain of each sandbox's history checked link by link, and against
  ``anchors``: the newest head of each chain the processor's checkpoints on the log name.
- ``verify``: every recorded input re-decided from the log into a scratch schema with today's
  (or pinned) rules, compared with what was recorded; the first divergence per sandbox.
- ``timeline``: a sandbox's state as of a time or an input (``at``) and the causal chain of
  its current incarnation (``explain``); ``page`` renders the latter as a self-contained page.
- ``export``: every input and decision as JSON Lines or Parquet, streamed in bounded memory.

Imports common and processor (to re-decide exactly as the processor does: its parser and its
batch planner).

- ``anchors``: the chain heads the log vouches for (the processor's checkpoints).
- ``golden``: recorded input logs of real runs, replayed through today's rules in CI.
- ``log``: read one partition of some topics from their beginning to their end as of the call.
- ``page``: ``explain --html``, one self-contained page of the causal chain.
- ``parquet``: the export's Parquet form; the one module that imports pyarrow (the ``parquet``
  extra, which the container image leaves out).
- ``shadow``: a read model rebuilt beside the live one, compared, switched in atomically.
"""
