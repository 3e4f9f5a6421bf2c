-- Providers: named sets of credentials. The values live here only, encrypted (AES-GCM under the
-- installation's key, which is not in the database); everything else in sandstream carries key
-- names, salted fingerprints and timestamps.

-- The per-installation salt of the fingerprints (HMAC-SHA256), made once.
CREATE TABLE credential_salt (
    id    boolean PRIMARY KEY DEFAULT true CHECK (id),
    salt  bytea NOT NULL
);

CREATE TABLE providers (
    name        text PRIMARY KEY,
    type        text NOT NULL,
    revision    integer NOT NULL,           -- +1 for every update that changed any value
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL
);

CREATE TABLE provider_credentials (
    provider     text NOT NULL REFERENCES providers (name) ON DELETE CASCADE,
    key          text NOT NULL,             -- the environment variable the agent sees
    nonce        bytea NOT NULL,
    ciphertext   bytea NOT NULL,            -- AES-GCM, associated data: provider and key
    fingerprint  text NOT NULL,             -- HMAC-SHA256(salt, provider, key, value)
    updated_at   timestamptz NOT NULL,
    PRIMARY KEY (provider, key)
);
