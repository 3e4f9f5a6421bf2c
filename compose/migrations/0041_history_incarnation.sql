-- The incarnation (sandbox_id) of the row each history entry left behind, so a history can be
-- narrowed to one incarnation of a reused name (`?incarnation=`). NULL when no row exists
-- (an input about an unknown name, a dead letter) and for entries written before this.
ALTER TABLE history ADD COLUMN sandbox_id uuid;
CREATE INDEX history_incarnation ON history (sandbox_id, id) WHERE sandbox_id IS NOT NULL;
