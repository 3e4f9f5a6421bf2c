"""The driver side: the executor turns decided intents into driver calls (serial per sandbox,
concurrent across sandboxes) and reports their results; the watcher forwards the driver's watch
stream; the reconcile loop reports differences between rows and backend. All three only report
observations: the processor decides.

``python -m services.executor`` runs them with the Podman driver. Imports services.common only.

- ``executor``: the executor, assembled from the five modules below (start, run, drain, health).
- ``intake``: its consumer of the events topic: records to work items, offsets, rebalances.
- ``queues``: one queue and one worker per sandbox, in log order, superseded intents skipped.
- ``calls``: one driver call: its slot or lane, the row check, provider values, retries.
- ``intents``: what each decided event or row asks of the driver, and whether it is wanted.
- ``progress``: which work is this executor's: owned partitions, committable offsets.
- ``rows``: the read of a sandbox's current row that every intent is checked against.
- ``credentials``: the attached providers' values a launch reads from PostgreSQL.
- ``clock``: where the executor and the reconciler read the time.
- ``watcher``: the driver's watch stream forwarded to the observations topic.
- ``reconcile``: the reconcile loop: rows against the runtime listing, strays, stuck rows.
- ``driver_side``: ``DriverSide``, executor + watcher + reconciler around one driver.
- ``backends``: the drivers built from the settings.
- ``log_sources``: the runtime log readers of the configured backends (for the API's logs).
- ``exec_sources``: the exec-capable driver of the settings (for the API's and OpenShell's exec).
- ``file_sources``: the file sources of the configured backends (for the API's files routes).
"""
