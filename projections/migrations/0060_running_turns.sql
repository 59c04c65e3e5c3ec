-- The turns still running, oldest first, across workspaces: what the gateway's sweep of
-- abandoned turns reads (gateway/turn_sweep.py). Few rows at any time, so a small index.
CREATE INDEX IF NOT EXISTS turns_running ON turns (started_at) WHERE status = 'running';
