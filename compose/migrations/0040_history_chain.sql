-- Tamper evidence: each history entry carries the hash of the previous entry of its chain
-- (one chain per sandbox key; unkeyed dead letters chain per input partition) and the hash of
-- its own content chained to it (projections/chain.py). Entries written before this migration
-- have neither and are reported as unchained by `sandstream audit chain`.
ALTER TABLE history ADD COLUMN prev_hash bytea, ADD COLUMN entry_hash bytea;
-- The processor reads each chain's head (its newest entry) before a write.
CREATE INDEX history_unkeyed ON history (partition, id) WHERE key IS NULL;
