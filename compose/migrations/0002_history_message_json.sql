-- The history keeps each input body verbatim for audit; `json` stores the text as it came,
-- which is cheaper to write than `jsonb` and keeps the producer's exact bytes.
ALTER TABLE history ALTER COLUMN message TYPE json USING message::json;
