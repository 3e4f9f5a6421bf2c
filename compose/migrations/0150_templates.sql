-- Templates: named, versioned sandbox specs (docs/pools.md, "Templates"). Every write adds a
-- revision; `templates` points at the newest, `template_revisions` keeps them all, so a
-- sandbox created from an older revision can still name what it came from. Configuration, not
-- state on the log: the log keeps each create's full spec, and replay never reads these.
CREATE TABLE IF NOT EXISTS templates (
    name text PRIMARY KEY,
    revision integer NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    created_by text NOT NULL,
    updated_by text NOT NULL
);
CREATE TABLE IF NOT EXISTS template_revisions (
    name text NOT NULL,
    revision integer NOT NULL,
    body jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    created_by text NOT NULL,
    PRIMARY KEY (name, revision)
);
-- The template revision a sandbox's create resolved its spec from ({name, revision} or NULL).
ALTER TABLE sandboxes ADD COLUMN IF NOT EXISTS template jsonb;
