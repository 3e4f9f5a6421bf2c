-- Warm pools and claims (docs/adr/0009). A pool member's row names its pool (kept after its
-- adoption, as provenance); an adopted member names the claimant it was adopted as and the
-- claim; a name bound to an adopted member is a tombstone row of its own that points at the
-- member (bound_to) under the claim that bound it.
ALTER TABLE sandboxes ADD COLUMN pool text;
ALTER TABLE sandboxes ADD COLUMN adopted_as text;
ALTER TABLE sandboxes ADD COLUMN claim_id text;
ALTER TABLE sandboxes ADD COLUMN bound_to text;

-- A claim's pick: the pool's Ready members no claim adopted yet.
CREATE INDEX sandboxes_pool_ready ON sandboxes (pool, updated_at)
    WHERE pool IS NOT NULL AND claim_id IS NULL AND phase = 'Ready';
-- A retried claim's look-up of the member it adopted.
CREATE INDEX sandboxes_claim ON sandboxes (claim_id) WHERE claim_id IS NOT NULL;
-- The doors' resolution of a user's name and the views' of a member's name.
CREATE INDEX sandboxes_bound_to ON sandboxes (bound_to) WHERE bound_to IS NOT NULL;

-- The bindings, as the doors and operators read them.
CREATE VIEW sandbox_names AS
    SELECT key AS name, bound_to AS key, claim_id, updated_at AS bound_at
    FROM sandboxes WHERE bound_to IS NOT NULL;
