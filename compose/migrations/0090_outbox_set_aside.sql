-- Outbox records the processor set aside instead of publishing them: larger than the largest
-- record it sends (SANDSTREAM_KAFKA_MAX_RECORD_BYTES), so Kafka could never take them. The
-- record stays in the outbox; the publish cursor moves past it, so nothing after it waits.
CREATE TABLE outbox_set_aside (
    outbox_id    bigint PRIMARY KEY,
    partition    integer NOT NULL,
    topic        text NOT NULL,
    key          bytea,
    size         integer NOT NULL,                  -- bytes of its key and value
    reason       text NOT NULL,
    set_aside_at timestamptz NOT NULL DEFAULT now()
);
