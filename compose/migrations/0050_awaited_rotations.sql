-- Credential rotations decided while a generation's launch was pending (restart already
-- pending): provider -> revision. The launch's report of the revisions it read is compared
-- with these; an older one restarts the agent once more. Cleared with the pending launch.
ALTER TABLE sandboxes
    ADD COLUMN awaited jsonb NOT NULL DEFAULT '{}';  -- {provider: revision}
