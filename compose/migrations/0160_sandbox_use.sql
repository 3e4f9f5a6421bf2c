-- Idle suspend: when each sandbox was last used through sandstream's doors (exec, files, logs,
-- a watch of it), as the API processes record it: one upsert per flush interval per process,
-- covering every sandbox used or with a session open in that interval. Not the log: the
-- scheduler reads it and puts what it read on the log (DeadlineDue idle, last_used_at).
CREATE TABLE sandbox_use (
    key           text PRIMARY KEY,
    last_used_at  timestamptz NOT NULL
) WITH (fillfactor = 50);  -- room on each page for the next version: updates stay HOT
-- The scheduler's idle scan: Ready rows with an idle timeout, and nothing else.
CREATE INDEX sandboxes_idle ON sandboxes (key)
    WHERE phase = 'Ready' AND hold IS NULL AND spec ? 'idle_suspend_seconds';
