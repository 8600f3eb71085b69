"""The benchmarks' harness: what every script in ``benchmarks/`` shares, one module per job.

The scripts run as ``python benchmarks/<name>.py`` and import this package as ``harness`` (their
own folder is first on ``sys.path``). Importing it puts the repository root on ``sys.path`` too, the
one place that does so, so that ``examples`` (the GPT every state is built from) imports without an
installed copy and the checkout's ``tierstate`` is the one measured.

- ``paths``: the repository's folders: results, scratch checkpoints, the default YAML.
- ``units``: byte units, sizes from text, and how seconds, ratios and bytes are printed.
- ``stats``: medians and the interleaved A B A B order of the runs.
- ``machine``: the machine's facts for the report, its load, its kernel knobs.
- ``rss``: resident memory and its high-water mark.
- ``disk``: the disk's own write and read bandwidth (O_DIRECT and buffered), dropping caches.
- ``tensors``, ``gpt_state``, ``dict_state``: the states every method saves.
- ``checkpointer``: the one interface every method is timed through.
- ``tierstate_checkpointer``, ``competitors``, ``copy_floor``: the methods.
- ``methods``: a method by name; a set of them opened and closed together.
- ``timing``: one checkpoint timed outside training; the untimed warm-up.
- ``training``: the training loop with checkpoints, interleaved over rounds.
- ``blocked_table``: the blocked-time table of ``blocked.py`` and ``gpu.py``.
- ``report``: tables printed and written to ``benchmarks/results/``.
- ``cli``: the arguments every script shares.
"""

import sys

from .paths import REPO_ROOT

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
