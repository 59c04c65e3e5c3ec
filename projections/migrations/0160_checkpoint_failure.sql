-- The poison event a projector stopped on, recorded where every process reads it: the
-- service that stopped, `svc projections status` in another process, and the service again
-- after a rebuild elsewhere moved the checkpoint (which clears it). NULL while it runs.
ALTER TABLE projection_checkpoints ADD COLUMN IF NOT EXISTS failure jsonb;
