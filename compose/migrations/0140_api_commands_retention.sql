-- The API forgets command ids older than SANDSTREAM_API_COMMAND_RETENTION_HOURS
-- (services/api/idempotency.py, docs/api.md "Idempotency"): its sweep finds them by age.
CREATE INDEX IF NOT EXISTS api_commands_recorded_at ON api_commands (recorded_at);
