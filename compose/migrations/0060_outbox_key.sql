-- The decided-event feed narrowed to sandboxes (`GET /v1/watch/events?name=`, `?incarnation=`)
-- reads their outbox records by key from the cursor on, not every record since the cursor.
-- IF NOT EXISTS: on a large outbox, build it first with CREATE INDEX CONCURRENTLY (this
-- transaction would hold the processor's writes while it builds).
CREATE INDEX IF NOT EXISTS outbox_key ON outbox (key, id);
