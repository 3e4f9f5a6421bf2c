-- The decided-event feed narrowed to sandboxes (`GET /v1/watch/events?name=`, `?incarnation=`)
-- reads their outbox records by key from the cursor on, not every record since the cursor.
CREATE INDEX outbox_key ON outbox (key, id);
