-- Each provider's incarnation: deleting a provider and creating one of the same name makes a
-- new provider whose revisions start again at 1. Rotation command ids include this id, so a
-- rotation of the new provider never repeats the id of one of the old provider (the processor
-- would take it for a duplicate and restart nothing).
ALTER TABLE providers ADD COLUMN incarnation uuid NOT NULL DEFAULT gen_random_uuid();
