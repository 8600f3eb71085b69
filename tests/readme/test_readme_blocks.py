"""The README runner's own parts: markers, console commands and their expected status, the tolerant match."""

from __future__ import annotations

from readme_blocks import blocks, console_commands, mismatch

SAMPLE = """Text.

<!-- readme-test: demo; stand-ins: model = a Linear(4, 4) -->
```console
$ tierstate verify 400 --config tiered     # a comment bash drops
nvme step 400: FAILED
  rank-00000.data frame 2: bytes 16781312..33558528: checksum mismatch (expected 5af78515ff33c979, got c688de2eadb3ec27)
$ echo $?
1
$ TIERSTATE_FAULT=migrate.frame@3 tierstate migrate 300 --from nvme --to pfs --config tiered
Killed                                        # (the test hook)
```

```python
print("no marker")
```
"""


def test_markers_name_the_scenario_and_only_the_block_right_after() -> None:
    first, second = blocks(SAMPLE)
    assert (first.line, first.language, first.scenario) == (4, "console", "demo")
    assert (second.language, second.scenario, second.text) == ("python", None, 'print("no marker")\n')


def test_console_commands_carry_their_output_and_the_status_the_readme_shows() -> None:
    verify, echo, killed = console_commands(blocks(SAMPLE)[0])
    assert verify.text.startswith("tierstate verify 400") and verify.line == 5
    assert verify.status == 1 and verify.shown[0] == "nvme step 400: FAILED"
    assert echo.status == 0 and echo.shown == ["1"]
    assert killed.status == 137 and killed.shown == []


def test_numbers_sizes_times_and_hashes_may_differ_words_and_columns_may_not() -> None:
    shown = ["step 600: copied 3 of 6 frames, 67.1 MB in 0.17 s (0.40 GB/s), verified",
             "nvme  300   committed, flushed   6   67,129,344  2026-12-02T15:45:56.897+00:00",
             "(expected 5af78515ff33c979, got c688de2eadb3ec27)"]  # fmt: skip
    printed = ["step 600: copied 5 of 8 frames, 6.3 MB in 0.05 s (93.0 MB/s), verified",
               "nvme 300 committed, flushed 2 6,291,456 2026-12-05T12:00:01.5+00:00",
               "(expected 0123456789abcdef, got fedcba9876543210)"]  # fmt: skip
    assert mismatch(shown, printed) is None
    assert mismatch(["ok (67.1 MB, 3.1 GB/s)"], ["ok (512 bytes, 4.1 kB/s)"]) is None  # every size unit the CLI writes
    assert mismatch(["stage units bytes"], ["stage units passed bytes"]) is not None  # a column missing
    assert mismatch(["step 600: verified"], ["step 600: verified", "step 700: verified"]) is not None  # a line
    assert mismatch(["nvme step 200: kept (keep_last=2)"], ["nvme step 200: deleted (keep_last=2)"]) is not None
