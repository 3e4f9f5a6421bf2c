-- Provider writes (create, update, rotate, delete) are idempotent by the same key as the
-- commands: their command_id is recorded in api_commands, in the write's own transaction, with
-- a fingerprint of the request (values enter it as HMACs under the installation's salt, never
-- in plaintext) and the write's outcome, which a retry with the same id gets back. A provider
-- write is never published (published stays false), so GET /v1/commands/{id} knows it not.
ALTER TABLE api_commands ADD COLUMN IF NOT EXISTS outcome jsonb;
