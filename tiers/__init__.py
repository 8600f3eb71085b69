"""Where bytes live: the host cache, the tiers (directories and buckets, one protocol: tier.py), the on-disk
format and its containers, reading a stored checkpoint (stored.py, the one door), and the operations on
tiers: migration and transfer, retention and the due rule, verification, export."""
