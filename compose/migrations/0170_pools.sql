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

-- The claims the API served from a pool's template, warm (a member adopted) or cold (the
-- fallback create): a count per path since the pool was created, and the newest claims of
-- each path (at most about 1,100: older ones are pruned) with why and how long the request
-- took, which the pool's status takes its latency figures from.
CREATE TABLE IF NOT EXISTS pool_claim_counts (
    pool   text NOT NULL,
    warm   boolean NOT NULL,
    count  bigint NOT NULL,
    PRIMARY KEY (pool, warm)
);
CREATE TABLE IF NOT EXISTS pool_claims (
    id          bigserial PRIMARY KEY,
    pool        text NOT NULL,
    claim_id    text NOT NULL,              -- the create's command id: a retry is not counted again
    claimant    text NOT NULL,
    warm        boolean NOT NULL,
    reason      text NOT NULL,
    seconds     double precision NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS pool_claims_path ON pool_claims (pool, warm, id);
CREATE UNIQUE INDEX IF NOT EXISTS pool_claims_id ON pool_claims (pool, claim_id);

-- The pool controller reads every pool's live members at each round (woken by every row
-- change): an index of the live pool members only, so that a round costs the pools' size, not
-- the whole table's (old members' tombstones keep `pool` but leave the index).
CREATE INDEX IF NOT EXISTS sandboxes_pool_live ON sandboxes (pool)
    WHERE pool IS NOT NULL AND phase <> 'Deleted';
