-- The lifecycle projection: phase rows and tombstones, history, command outcomes, the outbox
-- and the input offsets, all written in one transaction per partition batch.

CREATE TABLE sandboxes (
    key         text PRIMARY KEY,           -- the sandbox name (the Kafka key)
    sandbox_id  uuid NOT NULL,              -- this incarnation's stable id
    phase       text NOT NULL,              -- 'Deleted' is the tombstone
    generation  integer NOT NULL,
    version     bigint NOT NULL,
    spec        jsonb NOT NULL,
    providers   text[] NOT NULL,
    identity    text NOT NULL,
    exit_code   integer,
    reason      text,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    partition   integer NOT NULL,
    change_seq  bigint NOT NULL             -- position in the change feed (watch cursor)
);
CREATE INDEX sandboxes_live_phase ON sandboxes (phase, key) WHERE phase <> 'Deleted';
CREATE INDEX sandboxes_change_seq ON sandboxes (change_seq);
CREATE SEQUENCE sandbox_changes;

-- One row per input record, applied or not: the audit trail. (topic, partition, offset) is
-- unique, so an input can be recorded once only.
CREATE TABLE history (
    id            bigserial PRIMARY KEY,
    key           text,                     -- NULL for a dead-lettered record without a key
    topic         text NOT NULL,
    partition     integer NOT NULL,
    "offset"      bigint NOT NULL,
    message_type  text,
    command_id    text,
    disposition   text NOT NULL,            -- applied|idempotent|rejected|ignored|duplicate|dead-lettered
    reason        text NOT NULL,
    phase         text,                     -- the row's phase after this input
    generation    integer,
    version       bigint,
    event_types   text[] NOT NULL,
    message       jsonb,                    -- the input body (NULL when dead-lettered)
    occurred_at   timestamptz,
    recorded_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (topic, partition, "offset")
);
CREATE INDEX history_key ON history (key, id);

-- Command ids are idempotency keys per sandbox (decided inside the key's partition).
CREATE TABLE command_outcomes (
    key           text NOT NULL,
    command_id    text NOT NULL,
    command_type  text NOT NULL,
    status        text NOT NULL,            -- accepted|rejected
    code          text NOT NULL,
    message       text NOT NULL,
    outcome       jsonb NOT NULL,
    decided_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (key, command_id)
);
CREATE INDEX command_outcomes_id ON command_outcomes (command_id);

-- Records to publish after commit (decided events, dead letters). Per input partition the ids
-- grow in commit order (writers of one partition are serialized by its offset row lock), so a
-- single cursor per partition says what has been published.
CREATE TABLE outbox (
    id          bigserial PRIMARY KEY,
    partition   integer NOT NULL,
    topic       text NOT NULL,
    key         bytea,
    value       bytea NOT NULL
);
CREATE INDEX outbox_partition ON outbox (partition, id);

CREATE TABLE outbox_cursor (
    partition     integer PRIMARY KEY,
    published_id  bigint NOT NULL
);

-- The next offset to apply per input topic partition. Locked by every batch and only moved
-- forward: a writer whose records are below it (a zombie after a rebalance) writes nothing.
CREATE TABLE input_offsets (
    topic        text NOT NULL,
    partition    integer NOT NULL,
    next_offset  bigint NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
