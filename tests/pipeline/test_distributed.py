"""Many ranks, for real: two processes under ``torchrun --nproc_per_node=2`` on gloo, real files.

Two launches share the work to keep the suite fast (each costs a few seconds of start-up):
the first saves (and, last, loses rank 1 in the middle of a checkpoint), the test process then
writes a one-process checkpoint and loads a two-rank one, and the second launch is the "next
job" that restores everything. What each rank saw is in WORKDIR/<scenario>/rank-R.json
(see tests/dist_worker.py).
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_worker import (
    DTENSOR_SHAPE,
    GROUP_TIMEOUT_S,
    SHARDED_SHAPE,
    DTensorHolder,
    global_values,
    make_model,
    readme_guard,
)

from conftest import REPO
from launch import process_gone
from launch import torchrun as launch
from tierstate import cli
from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, RNGProvider, TensorDictProvider
from tierstate.tiers.format.format import parse_index
from tierstate.tiers.format.records import ShardedRecord, TensorRecord
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.reading.stored import StoredCheckpoint, load
from tierstate.tiers.storage.filesystem import FilesystemTier

WORKER = REPO / "tests" / "dist_worker.py"
LAUNCH_TIMEOUT_S = 180

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]


def torchrun(workdir: Path, *scenarios: str) -> None:
    """Run the scenarios on two ranks; ``--standalone`` rendezvous binds a free port itself."""
    launch(WORKER, workdir, 2, scenarios, REPO, LAUNCH_TIMEOUT_S)


def runner_on(tiers: Path) -> Runner:
    settings = {"tiers": {"nvme": {"path": str(tiers / "nvme")}, "pfs": {"path": str(tiers / "pfs")}}}
    return Runner.from_yaml(REPO / "configs" / "default.yaml", settings)


def whole_layout(scrambled: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """One process's providers for the state the ranks shard: whole tensors, no ShardInfo."""
    full = global_values()
    tensors = {"w": torch.zeros(SHARDED_SHAPE, dtype=torch.float64) if scrambled else full["shards/w"].clone()}
    holder = DTensorHolder(torch.zeros(DTENSOR_SHAPE, dtype=torch.bfloat16) if scrambled else full["dt/weight"])
    model = make_model(seed=99 if scrambled else 0)
    providers = {"model": ModuleProvider(model), "shards": TensorDictProvider(tensors), "dt": ModuleProvider(holder)}
    values = {"shards/w": tensors["w"], "dt/weight": holder.weight.detach()}
    values |= {f"model/{k}": v for k, v in model.state_dict().items()}
    return providers, values


def expected_whole() -> dict[str, torch.Tensor]:
    return {**global_values(), **{f"model/{k}": v for k, v in make_model(seed=0).state_dict().items()}}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("ranks")
    torchrun(workdir, "save", "ddp", "agree-save", "cadence", "agent", "failures")  # failures last: rank 1 leaves in it
    providers, _ = whole_layout(scrambled=False)
    with runner_on(workdir / "tiers" / "single") as runner:  # what the 1 -> 2 reshard loads
        runner.register(**providers)
        runner.checkpoint(5).result()
    torchrun(workdir, "restore", "reshard", "ddp-resume", "failures-restore", "agree")
    return workdir


def facts(work: Path, scenario: str) -> list[dict]:
    return [json.loads((work / scenario / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def test_save_then_restore_on_two_ranks_is_bit_exact(work):
    restored = facts(work, "restore")
    for rank, seen in enumerate(restored):
        assert seen["step"] == 1
        assert all(seen["same"].values()), (rank, seen["same"])
    saved = facts(work, "save")
    assert saved[0]["after"] != saved[1]["after"]  # each rank's own RNG stream came back to it


def test_restore_reads_each_stored_byte_once_per_node(work):
    # Both ranks share one node: the replicated model is read half by each and exchanged.
    manifest = runner_on(work / "tiers" / "save").durable_tier.manifest(1)
    reads = [seen["bytes_read"] for seen in facts(work, "restore")]
    assert all(r > 0.3 * manifest.stored_bytes for r in reads)
    assert sum(reads) <= manifest.stored_bytes  # at most one pass over the copy (objects apart)


def test_replicated_state_is_written_once_and_spread_over_ranks(work):
    step = work / "tiers" / "save" / "nvme" / "step-1"
    assert sorted(p.name for p in step.iterdir()) == [
        "manifest.json", "rank-00000.data", "rank-00000.index", "rank-00001.data", "rank-00001.index",
    ]  # fmt: skip
    manifest = runner_on(work / "tiers" / "save").durable_tier.manifest(1)
    model = {k: r for k, r in manifest.items.items() if k.startswith("model/")}
    assert model and all(isinstance(r, TensorRecord) for r in model.values())  # one record each, no per-rank copy
    writers = {r.pieces[0].file for r in model.values()}
    assert writers == {"rank-00000.data", "rank-00001.data"}  # the write load is spread
    model_bytes = sum(manifest.item_nbytes(k) for k in model)
    assert manifest.raw_bytes < 1.5 * model_bytes  # not twice: the model is most of this state
    sizes = [f.size for f in manifest.files.values()]
    assert max(sizes) < 0.7 * sum(sizes)
    assert manifest.stats is not None and sorted(manifest.stats) == [0, 1]  # what each rank's part cost
    assert manifest.items["run/value"].kind == "object" and manifest.items["rng/torch"].kind == "per_rank"
    assert isinstance(manifest.items["shards/w"], ShardedRecord) and len(manifest.items["shards/w"].shards) == 2


def test_a_rank_that_fails_or_dies_leaves_no_commit_and_the_others_go_on(work):
    first, second = facts(work, "failures")
    for seen in (first, second):
        assert seen["first"].endswith("step-1") and seen["fourth"].endswith("step-4")
    assert first["refused"].startswith("CheckpointAborted: step 2 was not committed: rank 1: ObjectCodecError")
    assert second["refused"].startswith("ObjectCodecError: item 'mine/value'")  # rank 1 reports its own error
    assert first["declined"] == (
        "CheckpointAborted: step 3 was not opened: rank 1: RuntimeError: sampler state unavailable"
    )
    assert second["declined"] == "RuntimeError: sampler state unavailable"
    assert first["replanned"].startswith("CheckpointAborted: step 5 was not opened: rank 1: PlanChangedError")
    assert second["replanned"].startswith("PlanChangedError: a tensor planned as torch.float32")
    assert first["died"].startswith("GroupLost: step 6: collecting votes: lost the checkpoint group")
    assert "unusable since step 6" in first["after"]  # later checkpoints fail at once, training went on
    assert "died" not in second  # rank 1 left the process before recording more
    tier = work / "tiers" / "failures" / "nvme"
    assert sorted(p.name for p in tier.iterdir()) == ["step-1", "step-4"]  # no other step, no partials
    for rank, seen in enumerate(facts(work, "failures-restore")):
        assert seen["step"] == 4 and all(seen["same"].values()), rank


def test_two_ranks_checkpoint_loads_on_one_process(work):
    providers, values = whole_layout(scrambled=True)
    with runner_on(work / "tiers" / "save") as runner:
        runner.register(**providers)
        assert runner.restore("latest").step == 1
    for key, want in expected_whole().items():
        assert torch.equal(values[key], want), key
    plain = load(work / "tiers" / "save" / "nvme" / "step-1")
    assert torch.equal(plain["shards/w"], global_values()["shards/w"])
    assert plain["mine/value"] == {"rank": 0}  # per-rank items as rank 0 had them


def test_one_process_checkpoint_loads_resharded_on_two_ranks(work):
    for rank, seen in enumerate(facts(work, "reshard")):
        assert seen["step"] == 5 and all(seen["same"].values()), (rank, seen["same"])


def test_ddp_training_resumes_with_identical_losses(work):
    trained, resumed = facts(work, "ddp"), facts(work, "ddp-resume")
    for rank in (0, 1):
        assert resumed[rank]["step"] == 4
        assert resumed[rank]["losses"] == trained[rank]["losses"], rank  # exact floats


def test_ranks_with_an_auto_cadence_checkpoint_the_same_steps(work):
    """Each rank times its own steps and checkpoints; rank 1 measures more: they agree at each checkpoint."""
    ranks = facts(work, "cadence")
    assert ranks[0]["taken"] == ranks[1]["taken"], ranks
    assert ranks[0]["taken"][0] == 3 and len(ranks[0]["taken"]) >= 2  # the first after the warm-up's 2 steps
    assert all(r["committed"] == [True] * len(r["taken"]) for r in ranks)


def test_the_ranks_of_a_node_share_one_agent_that_flushes_both_parts(work, capsys):
    """Two DDP ranks of one node, the memory tier and the node agent: one agent served both (the same pid, both
    trainers attached to it), each step NVMe receives holds both ranks' parts, verified, the values trained,
    and the agent ended once both ranks closed."""
    ranks = facts(work, "agent")
    agent = ranks[0]["agent"]
    assert agent is not None and agent == ranks[1]["agent"] and agent not in (ranks[0]["pid"], ranks[1]["pid"])
    assert ranks[0]["attached"] == ranks[1]["attached"] == sorted(r["pid"] for r in ranks)
    nvme = work / "tiers" / "agent" / "nvme"
    assert all(r["failures"] == [] and r["flushed"] == [str(nvme / f"step-{s}") for s in (2, 4, 6)] for r in ranks)
    assert FilesystemTier("nvme", nvme).steps() == [2, 4, 6]
    assert cli.main(["verify", f"--tier=nvme={nvme}", "2", "4", "6"]) == 0
    capsys.readouterr()
    for step in (2, 4, 6):
        assert cli.main(["inspect", str(nvme / f"step-{step}"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ranks"] == 2
    stored = StoredCheckpoint(nvme / "step-6", 6).read()
    for key, values in ranks[0]["model"].items():
        [name] = [k for k in stored if k.startswith("model/") and k.endswith(key.removeprefix("module."))]
        assert stored[name].flatten().tolist() == values, key
    assert process_gone(agent, 30), "the agent outlived both ranks with nothing left to flush"


def test_tier_tool_shows_multi_rank_checkpoints(work, capsys):
    nvme = work / "tiers" / "save" / "nvme"
    assert cli.main(["inspect", str(nvme / "step-1"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    kinds = {row["key"]: row["kind"] for row in shown["item_table"]}
    assert shown["ranks"] == 2 and shown["files"] == 2
    assert kinds["shards/w"] == "sharded" and kinds["rng/torch"] == "per-rank" and kinds["model/0.weight"] == "tensor"
    assert cli.main(["ls", "--tier", f"nvme={nvme}", "--json"]) == 0
    assert [(e["step"], e["state"], e["ranks"]) for e in json.loads(capsys.readouterr().out)] == [(1, "committed", 2)]


def test_migrate_and_verify_keep_every_rank_file(work, tmp_path):
    source = FilesystemTier("nvme", work / "tiers" / "save" / "nvme")
    target = FilesystemTier("pfs", tmp_path / "pfs")
    migrate(1, source, target)
    assert verify_step(target, 1).ok
    assert sorted(p.name for p in target.step_dir(1).glob("rank-*")) == [
        "rank-00000.data", "rank-00000.index", "rank-00001.data", "rank-00001.index",
    ]  # fmt: skip
    copied, original = load(target.step_dir(1)), load(source.step_dir(1))
    for key, value in original.items():
        assert torch.equal(copied[key], value) if isinstance(value, torch.Tensor) else copied[key] == value, key


def test_format_rewrite_of_a_multi_rank_checkpoint_keeps_each_rank_its_own_index(work, tmp_path):
    source = FilesystemTier("nvme", work / "tiers" / "save" / "nvme")
    target = FilesystemTier("pfs", tmp_path / "pfs")
    migrate(1, source, target, fmt="hdf5")
    assert verify_step(target, 1).ok
    step_dir = target.step_dir(1)
    for rank in (0, 1):
        index = parse_index((step_dir / f"rank-{rank:05d}.index").read_bytes(), f"rank {rank} index")
        files = {p.file for record in index.items.values() for p in getattr(record, "pieces", [])}
        assert index.rank == rank and files == {f"rank-{rank:05d}.h5"}
    copied, original = load(step_dir), load(source.step_dir(1))
    for key, value in original.items():
        assert torch.equal(copied[key], value) if isinstance(value, torch.Tensor) else copied[key] == value, key


# --- ranks with different tiers agree on a step, or all fail alike (issue 11 item 6) -------------------------------


def agreement(work: Path, case: str) -> list[dict]:
    """What each rank saw in one case of the ``agree`` scenario (see dist_worker.AGREE_CASES)."""
    return [seen[case] for seen in facts(work, "agree")]


def test_ranks_restore_the_newest_step_each_from_its_own_fastest_copy(work):
    first, second = agreement(work, "newest-on-a-slower-tier")  # rank 1's NVMe lacks step 3, its PFS has it
    assert (first["step"], first["tier"], second["step"], second["tier"]) == (3, "nvme", 3, "pfs")
    assert first["same"] and second["same"]


def test_ranks_restore_the_newest_step_every_rank_holds(work):
    for seen in agreement(work, "older-common-step"):  # rank 1 holds steps 1 and 2 only
        assert seen["step"] == 2 and seen["same"]
        assert seen["problems"] == ["step 3 is not on every rank: rank(s) 1 lack it"]


def test_a_copy_one_rank_cannot_read_sends_every_rank_to_the_older_step(work):
    for seen in agreement(work, "unreadable-copy-fallback"):
        assert seen["step"] == 1 and seen["same"]
        skipped = seen["problems"][1]
        assert re.match(r"step 2 on rank 1, tier nvme: CorruptCheckpointError: .*checksum mismatch", skipped)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-common-step", r"NoCheckpointError: restore latest: no step is committed on a tier of every rank "
                           r"\(rank 0: nvme=\S+/only3/nvme \[3\], pfs=\S+ \[\]; rank 1: nvme=\S+/old/nvme \[1, 2\]"),
        ("guard-one-rank-has-none", r"NoCheckpointError: restore latest: no step is committed on a tier of every rank"),
        ("unreadable-copy", r"NoCheckpointError: cannot restore step 2: .*step 2 on rank 1, tier nvme: "
                            r"CorruptCheckpointError: \S+/corrupt/nvme/step-2/rank-00001.data frame \d+: checksum"),
        ("check-fails-on-rank-1", r"RestoreError: restore step 3: checking the state: rank 1: ChildRestoreError: "
                                  r"provider 'model': .*4\.weight: checkpoint float32\[8, 48\], live float32\[9, 48\]"),
        ("restore-fails-on-rank-1", r"RestoreError: restore step 3: restoring the providers without check: "
                                    r"rank 1: RuntimeError: counters \{'step': 3\} refused$"),
    ],
)  # fmt: skip
def test_ranks_that_cannot_restore_the_same_step_all_fail_alike_within_seconds(work, case, message):
    first, second = agreement(work, case)
    assert first["error"] == second["error"] and re.match(message, first["error"]), first["error"]
    for seen in (first, second):
        assert seen["seconds"] < GROUP_TIMEOUT_S / 2  # no rank waited in a collective for the group timeout
        assert seen["unchanged"]  # also rank 0's, whose own check and restore went through


def test_the_readme_guard_starts_fresh_on_every_rank_and_cannot_hang(work):
    for seen in agreement(work, "guard-no-checkpoint-anywhere"):
        assert seen["guard"] == "went on" and seen["seconds"] < GROUP_TIMEOUT_S / 2
    body = textwrap.dedent("".join(inspect.getsource(readme_guard).splitlines(keepends=True)[2:]))
    assert body in (REPO / "README.md").read_text()  # the worker runs what the README shows


def test_per_rank_rng_saved_on_one_rank_is_never_copied_to_another(tmp_path: Path) -> None:
    """Saved by one process, restored on two: rank 0 gets the saved streams; rank 1 gets streams of its own
    derived from rank 0's and its rank, and says so (both drawing the same numbers was the silent failure,
    and keeping its own left ranks seeded alike drawing alike); asked to, it keeps its own, or every rank
    refuses instead."""
    torch.manual_seed(42)
    rng = RNGProvider()
    with runner_on(tmp_path / "tiers" / "rng1") as runner:
        runner.register(rng=rng, t=TensorDictProvider({"w": torch.arange(4.0)}))
        runner.checkpoint(3).result()
    digest = rng.digest()  # the saved state, as rank 0 will have restored it
    saved_draws = torch.rand(4).tolist()
    rng.derive(digest, 1)
    derived_draws = torch.rand(4).tolist()  # what rank 1 must draw: derived from rank 0's state and rank 1
    torch.manual_seed(1001)
    own_draws = torch.rand(4).tolist()  # rank 1's stream, seeded 1000 + 1 before its restore
    assert len({tuple(saved_draws), tuple(derived_draws), tuple(own_draws)}) == 3
    torchrun(tmp_path, "rng-more-ranks")
    rank0, rank1 = (json.loads((tmp_path / "rng-more-ranks" / f"rank-{r}.json").read_text()) for r in (0, 1))
    w = [0.0, 1.0, 2.0, 3.0]
    assert rank0["derive"] == {"kept": [], "derived": [], "w": w, "draws": saved_draws}
    assert rank1["derive"] == {"kept": [], "derived": ["rng"], "w": w, "draws": derived_draws}
    assert rank0["keep"] == {"kept": [], "derived": [], "w": w, "draws": saved_draws}
    assert rank1["keep"] == {"kept": ["rng"], "derived": [], "w": w, "draws": own_draws}
    for seen in (rank0, rank1):
        error = seen["error"]["error"]
        assert "MissingItemError" in error and "'rng' hold(s) each rank's own state" in error
        assert "none of them rank 1" in error
        assert seen["error"]["w"] == [0.0, 0.0, 0.0, 0.0]  # nothing applied on any rank
