"""What is done to checkpoints on tiers: copying (migrate between directories, transfer between any two),
what is due where (due.py) and retention, flushes a crash left pending, verification and its stamps, setting
a run aside, listings for ls, and exports (single files, HF model directories)."""
