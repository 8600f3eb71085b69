"""Where checkpoints live and how they are kept safe there: the one tier interface (tier.py) and its two
backends, a directory (filesystem.py: the commit protocol, locks, safe opening, ownership, node scopes, node
parts on a shared tier, peer copies) and a bucket prefix (s3tier.py over objstore.py: claims, conditional
puts); the host cache; the fault points the fault suite kills at."""
