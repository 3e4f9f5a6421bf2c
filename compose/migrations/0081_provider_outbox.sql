-- The commands the provider service owes sandboxes: the RotateCredentials of an update and the
-- DetachProvider of a forced delete, stored in the transaction that stored the values (or
-- deleted the provider), so that a stored change always reaches its sandboxes. The request
-- publishes them after commit; every API and provider-sync process relays what is left until
-- Kafka acknowledges it (docs/providers.md, "Delivery"). A row is deleted once acknowledged.
-- Names, revisions and ids only: never a value.
CREATE TABLE provider_outbox (
    command_id  text PRIMARY KEY,
    key         text NOT NULL,
    command     text NOT NULL,                    -- the command's JSON, as published
    stored_at   timestamptz NOT NULL DEFAULT now(),
    attempts    integer NOT NULL DEFAULT 0,       -- failed publishes so far
    last_error  text
);
CREATE INDEX provider_outbox_stored_at ON provider_outbox (stored_at);
