"""Where bytes live: host cache, GPU side, filesystem tiers, on-disk format and migration."""
