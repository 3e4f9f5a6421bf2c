-- A claim's env and providers (docs/pools.md): the providers a claim attached to the member it
-- adopted (their values reach every exec through sandstream's doors) and the generation it was
-- adopted at (while it runs, its process never read them: a rotation of only these restarts
-- nothing).
ALTER TABLE sandboxes ADD COLUMN claim_providers text[] NOT NULL DEFAULT '{}';
ALTER TABLE sandboxes ADD COLUMN adopted_generation int;
