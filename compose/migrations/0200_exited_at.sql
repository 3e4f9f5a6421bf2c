-- When the current generation's runtime was seen to exit (the exit's time, on the backend's
-- clock; NULL while no exit of it is known). A running of that generation dated no later is
-- late, not news: it lifts no Error (docs/state-machine.md, observations).
ALTER TABLE sandboxes ADD COLUMN IF NOT EXISTS exited_at timestamptz;

-- Rows that exited before this column: the time of the input that decided the exit, as the
-- rebuild from the log sets it (the decided events carry their input's time), so a replay or
-- an audit finds the rows it would make.
UPDATE sandboxes s SET exited_at = (
    SELECT h.occurred_at FROM history h
    WHERE h.key = s.key AND h.generation = s.generation
      AND h.event_types && ARRAY['SandboxCompleted', 'SandboxFailed', 'AgentRestartFailed']
    ORDER BY h.id DESC LIMIT 1
)
WHERE s.phase IN ('Completed', 'Error') AND s.exit_code IS NOT NULL AND s.exited_at IS NULL;
