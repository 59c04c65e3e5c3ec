-- Each turn's recorded expiry (TurnStarted.expires_at: actors/conversation.py, turn_lifetime),
-- for the gateways' sweep of abandoned turns (gateway/turn_sweep.py), which picks running
-- turns by the expiry each recorded, not by their age under the budget in force now.
--
-- expires_at is 'infinity' for a turn that never expires (its call had no time limit) and
-- NULL for a turn recorded before turns carried an expiry: the sweep judges those by their
-- start and the budget in force, as the conversation does.
--
-- Only the column here: adding it is a catalogue change, and the lock it takes ends with this
-- file's transaction, before 0151 builds the index and fills the running turns.

ALTER TABLE turns ADD COLUMN IF NOT EXISTS expires_at timestamptz;
