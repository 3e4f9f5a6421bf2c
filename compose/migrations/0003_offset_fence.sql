-- The processor writes a batch in one statement that moves the batch's input offsets from the
-- values it read to the new ones (compare-and-set). If any offset row is no longer what it read,
-- another writer committed in between: this aborts the whole statement, so nothing is written,
-- and the processor reads and decides the batch again.
CREATE FUNCTION offsets_fence(moved bigint, expected bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF moved <> expected THEN
        RAISE EXCEPTION 'input offsets moved since they were read (% of % as expected)',
            moved, expected
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN true;
END
$$;
