-- Which assignment of a partition may write it. A processor assigned a partition raises its
-- epoch (creating the row if need be) before it reads the stored offsets and publishes what
-- the previous owner left, and every batch it writes moves the offsets only where the epoch is
-- still the one it raised. So a previous owner that learns of the rebalance late (a zombie)
-- commits nothing after the new owner took over: everything committed is published by the new
-- owner before its own decisions, and decided events reach sandbox.events in decision order.
-- A batch written with no epoch (the rebuild, tools, tests driving a processor directly) is
-- fenced by the offsets alone, as before.
ALTER TABLE input_offsets ADD COLUMN IF NOT EXISTS owner_epoch bigint NOT NULL DEFAULT 0;
