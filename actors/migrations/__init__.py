"""SQL migrations of the actor runtime (the `ray` runtime's shard map)."""
