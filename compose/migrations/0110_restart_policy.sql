-- The restart policy's record in the row: restarts in all and in a row, the last exit, since
-- when the current generation is Ready ({count, attempt, last_exit, ready_since} or NULL). A
-- scheduled restart is the row's deadline of kind 'restart' (found through deadline_at).
ALTER TABLE sandboxes ADD COLUMN restarts jsonb;
