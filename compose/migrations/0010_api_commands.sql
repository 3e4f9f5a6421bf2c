-- Commands the API took in, with a fingerprint of their request: an idempotency key
-- (command_id) reused for a different request is refused (409), also across incarnations of a
-- name, and GET /v1/commands/{id} tells "published, pending" from "never seen" (404).
-- published is set once Kafka acknowledged the record.
CREATE TABLE api_commands (
    command_id    text PRIMARY KEY,
    key           text NOT NULL,
    command_type  text NOT NULL,
    actor         text NOT NULL,
    fingerprint   text NOT NULL,
    published     boolean NOT NULL DEFAULT false,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);
