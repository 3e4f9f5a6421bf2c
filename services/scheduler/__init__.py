"""The scheduler: brings time into the log. It watches the deadlines and expiry times recorded
in the rows and, when one falls due, publishes a DeadlineDue observation to the sandbox's
partition; the processor's fold decides what that means. Ids are deterministic and the fold
acts only on the deadline the row still holds, so a restarted scheduler catching up (or two of
them) never makes anything happen twice. Beside it, the pool controller keeps every warm pool
at its size by publishing ordinary commands (docs/pools.md).

``python -m services.scheduler`` runs it alone; ``sandstream up`` runs it in the control plane.
Imports services.common only.

Modules:

- ``pool_controller``: keep every warm pool at its size with ordinary commands.
- ``pool_plan``: what one pool needs now (pure).
- ``scheduler``: publish a DeadlineDue for every deadline of a live row that has passed.
- ``scheduling``: both together, the work of whoever holds the ``scheduler`` lease.
"""
