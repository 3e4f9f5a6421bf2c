-- The row write is a compare-and-set on the version too: each written row says the version it
-- was decided from (none for a new row), and if any row is no longer at that version the whole
-- batch statement aborts. Per-sandbox order rests on all its records being in one partition
-- (checked by the processor); this makes any break of that rule a loud error, not a lost update.
CREATE FUNCTION rows_fence(written bigint, expected bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF written <> expected THEN
        RAISE EXCEPTION 'sandbox rows moved since they were read (% of % at the version the batch '
                        'was decided from): a sandbox is written from two partitions?',
            written, expected
            USING ERRCODE = 'SSV01';
    END IF;
    RETURN true;
END
$$;

-- An input partition the processor stopped at a record it could neither apply nor dead-letter
-- (PostgreSQL refused both). The other partitions go on; `/readyz` names this one until an
-- operator skips the record (`sandstream processor skip`, recorded in the history) or lets the
-- processor retry it (`sandstream processor retry`).
CREATE TABLE stopped_partitions (
    topic       text NOT NULL,
    partition   integer NOT NULL,
    "offset"    bigint NOT NULL,            -- the record it stopped at
    key         text,                       -- the record's key (NUL and the like escaped)
    reason      text NOT NULL,              -- what PostgreSQL answered
    stopped_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
