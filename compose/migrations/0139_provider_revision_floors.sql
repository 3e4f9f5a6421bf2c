-- A provider's revisions never go back under its name: deleting a provider records the last
-- revision it reached, and a provider created again under that name starts after it (1 for a
-- name never used). A launch reports the revision of each provider it read, and a rotation
-- the revision the agent must have; both are compared as numbers (a launch that read fewer
-- than awaited restarts once more), which holds across incarnations only if a newer
-- incarnation's revisions are all greater than an older one's. With revisions from 1 again, a
-- launch that read the deleted provider's revision 6 counted as having read the new one's
-- rotation to revision 2.
CREATE TABLE IF NOT EXISTS provider_revision_floors (
    name text PRIMARY KEY,
    revision bigint NOT NULL CHECK (revision >= 0)
);
