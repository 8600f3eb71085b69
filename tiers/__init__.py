"""Where bytes live: host cache, filesystem tiers, containers, the on-disk format, reading and migration."""
