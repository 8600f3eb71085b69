"""How bytes move: the YAML pipeline spec and its checks, the stage chain and its threads, the runner (its
engine, its listeners after a commit: flushes along the flush graph, buckets, peer copies), the commit
among ranks, and restore on one rank or many."""
