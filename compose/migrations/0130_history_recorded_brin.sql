-- The console's chart of phase counts over the last hours (services/api/readmodel/trend.py)
-- reads the history entries recorded in its window, not the whole history. The history is
-- appended in recorded_at order, so a BRIN index (a few pages, almost nothing per insert)
-- finds them; autosummarize summarises each range soon after it fills, so only the newest are
-- read whole. IF NOT EXISTS: on a large history, build it first with CREATE INDEX CONCURRENTLY.
CREATE INDEX IF NOT EXISTS history_recorded ON history USING brin (recorded_at)
    WITH (autosummarize = on);
