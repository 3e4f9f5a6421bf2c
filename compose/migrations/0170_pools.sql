-- Warm pools (docs/pools.md, "Warm pools"): configuration written by the API, like providers
-- and templates. The pool controller (in the scheduler role) keeps `size` members of each,
-- deciding nothing itself: every create and delete it wants is a command on the log.
CREATE TABLE IF NOT EXISTS pools (
    name        text PRIMARY KEY,
    template    text NOT NULL,
    size        integer NOT NULL CHECK (size >= 0),
    strategy    text NOT NULL CHECK (strategy IN ('Recreate', 'OnReplenish')),
    revision    integer NOT NULL,           -- +1 per update: the API's optimistic concurrency
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    created_by  text NOT NULL,
    updated_by  text NOT NULL,
    problem     text                        -- the controller's: why it cannot fill the pool now
);

-- Creates the controller has asked for and the fold has not made a row of yet: written before
-- the command is published, so a controller killed after publishing (or before) counts them
-- after its restart instead of creating again; the command is kept to publish it again (same
-- id: the processor answers a retry with the first outcome). Not tied to `pools`: a member
-- asked for by a pool deleted since must still be found (and deleted) once it exists.
CREATE TABLE IF NOT EXISTS pool_requests (
    key           text PRIMARY KEY,
    pool          text NOT NULL,
    command_id    text NOT NULL,
    command       jsonb NOT NULL,
    requested_at  timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS pool_requests_pool ON pool_requests (pool);

-- One row per claim the API served from a pool's template: warm (a member adopted) or cold
-- (the fallback create), why, and how long the request took; the pool's status reads them.
CREATE TABLE IF NOT EXISTS pool_claims (
    id          bigserial PRIMARY KEY,
    pool        text NOT NULL,
    claimant    text NOT NULL,
    warm        boolean NOT NULL,
    reason      text NOT NULL,
    seconds     double precision NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS pool_claims_pool ON pool_claims (pool, id);
