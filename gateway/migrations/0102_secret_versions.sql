-- A secret setting's value is written under a version before the settings event that names
-- it is recorded (gateway/settings.py SettingsService.set). A change that then fails to record
-- leaves the version in force unchanged, and a change recorded after its caller gave up (a
-- timed-out ask) finds its value there. Rows written before versions existed are version ''.
ALTER TABLE instance_secrets ADD COLUMN IF NOT EXISTS version text NOT NULL DEFAULT '';
ALTER TABLE instance_secrets DROP CONSTRAINT IF EXISTS instance_secrets_pkey;
ALTER TABLE instance_secrets ADD PRIMARY KEY (key, version);
