-- The ray runtime's shard map (actors/shards.py). A logical actor's key hashes to one of
-- 1024 shards; each shard is owned by one host at a time, named by `host`, and `epoch`
-- grows by one every time the shard changes owner. A router sends (shard, epoch) with every
-- command and a host refuses an epoch that is not its own, so a command routed by a stale
-- map is retried, never run by two hosts.
CREATE TABLE IF NOT EXISTS actor_clusters (
    cluster    text PRIMARY KEY,
    hosts      integer NOT NULL CHECK (hosts > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS actor_shards (
    cluster  text NOT NULL REFERENCES actor_clusters (cluster) ON DELETE CASCADE,
    shard    integer NOT NULL CHECK (shard >= 0),
    host     text NOT NULL,
    epoch    bigint NOT NULL CHECK (epoch > 0),
    moved_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (cluster, shard)
);
CREATE INDEX IF NOT EXISTS actor_shards_host ON actor_shards (cluster, host);
