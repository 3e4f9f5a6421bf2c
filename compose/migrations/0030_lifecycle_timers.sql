-- Operator lifecycle in the row: the current phase's deadline, the time to live and its
-- policy, the completion policy, and an operator's hold. The scheduler finds what falls due
-- through deadline_at and expires_at (deadline_at repeats deadline->>'due_at' as a column).
ALTER TABLE sandboxes
    ADD COLUMN deadline     jsonb,               -- {kind, due_at, attempt} or NULL
    ADD COLUMN deadline_at  timestamptz,
    ADD COLUMN expires_at   timestamptz,         -- end of the time to live, or NULL
    ADD COLUMN on_expiry    text NOT NULL DEFAULT 'stop',   -- stop|delete
    ADD COLUMN on_exit      text NOT NULL DEFAULT 'keep',   -- keep|delete
    ADD COLUMN hold         jsonb;               -- {by, reason, since} or NULL
CREATE INDEX sandboxes_deadline_at ON sandboxes (deadline_at) WHERE deadline_at IS NOT NULL;
CREATE INDEX sandboxes_expires_at ON sandboxes (expires_at) WHERE expires_at IS NOT NULL;
