-- Where the hash chain began (migration 0040): every history entry with this id or above must
-- carry its hashes, so `sandstream audit chain` reports one without them as a removed hash
-- rather than as an older, unchained entry. Set once, here: the first entry written with a
-- hash, or, if none was yet, the next id (every entry from now on gets one). Without this row
-- the audit takes every entry for a chained one (it fails closed).
CREATE TABLE history_chain_start (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    first_id bigint NOT NULL
);
INSERT INTO history_chain_start (first_id)
SELECT coalesce(
    (SELECT min(id) FROM history WHERE entry_hash IS NOT NULL),
    (SELECT max(id) + 1 FROM history),
    1
);
