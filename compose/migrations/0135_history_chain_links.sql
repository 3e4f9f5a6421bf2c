-- One successor per chain entry, whoever writes it. A chain has one writer only while every
-- entry of a key comes from its key's partition; a record on another partition (dead-lettered
-- there, projections/chain.py) joins its key's chain from that partition's owner, and
-- `processor skip` writes one from the CLI. Two such writers can read the same head and link
-- an entry onto it each: a fork. These indexes refuse the second link (a unique violation the
-- processor takes for a moved chain: it decides its batch again on the new head).
-- A link: no two entries follow one entry (an entry hash names its chain).
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_next ON history (prev_hash)
    WHERE prev_hash IS NOT NULL;
-- A chain's first entry: one per key, and one per partition for the unkeyed dead letters. The
-- key itself is indexed (history_key indexes it already: a dead letter keeps at most 256 bytes
-- of a key), not a function of it: an index on a function of this schema would stay bound to
-- the schema a promoted shadow (`audit promote`) was built in.
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_first ON history (key)
    WHERE prev_hash IS NULL AND entry_hash IS NOT NULL AND key IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS history_chain_first_unkeyed ON history (partition)
    WHERE prev_hash IS NULL AND entry_hash IS NOT NULL AND key IS NULL;
