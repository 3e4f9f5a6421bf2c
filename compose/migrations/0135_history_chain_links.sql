-- One successor per chain entry, whoever writes it. A chain has one writer only while every
-- entry of a key comes from its key's partition; a record on another partition (dead-lettered
-- there, projections/chain.py) joins its key's chain from that partition's owner, and
-- `processor skip` writes one from the CLI. Two such writers can read the same head and link
-- an entry onto it each: a fork. These indexes refuse the second link (a unique violation the
-- processor takes for a moved chain: it decides its batch again on the new head).
-- A link: no two entries follow one entry (an entry hash names its chain).
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_next ON history (prev_hash)
    WHERE prev_hash IS NOT NULL;
-- A chain's first entry: one per key (by the key's sha256: a dead letter's key can be longer
-- than an index entry holds) and one per partition for the unkeyed dead letters.
CREATE FUNCTION history_chain_key(key text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN sha256(convert_to(key, 'UTF8'));
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_first ON history (history_chain_key(key))
    WHERE prev_hash IS NULL AND entry_hash IS NOT NULL AND key IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_first_unkeyed ON history (partition)
    WHERE prev_hash IS NULL AND entry_hash IS NOT NULL AND key IS NULL;
