"""Lightning through TierstateCheckpointIO: asynchronous tiered saves, and ckpt_path="last" resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tierstate.integrations.lightning import read_pointer
from tierstate.tiers.storage.filesystem import FilesystemTier

WORKER = Path(__file__).with_name("lightning_worker.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _pointer(path: Path) -> dict[str, object]:
    """The pointer Lightning's checkpoint path holds (failing the test if it holds none)."""
    pointer = read_pointer(path)
    assert pointer is not None, f"{path} is no tierstate pointer"
    return pointer


def _losses(output: str) -> dict[int, str]:
    lines = (line.split() for line in output.splitlines() if line.startswith("loss "))
    return {int(step): bits for _tag, step, bits in lines}


def _run(root: Path, epochs: int, *flags: str) -> dict[int, str]:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(root), str(epochs), *flags],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "failures 0" in done.stdout
    return _losses(done.stdout)


def test_import_tierstate_and_the_integration_module_do_not_import_lightning() -> None:
    code = "import sys, tierstate, tierstate.integrations.lightning; print('lightning' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.slow
def test_sigkilled_run_resumes_from_last_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    uninterrupted = _run(tmp_path / "whole", 4)
    assert sorted(uninterrupted) == list(range(16))  # 4 epochs of 4 batches

    # Killed in epoch 3 (before step 10), once the epoch-2 checkpoint (after step 7) is durable.
    killed = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, str(WORKER), str(killed), "4", "--hang-at", "10"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(),
    )  # fmt: skip
    try:
        seen = []
        for line in child.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.strip() == "READY":
                break
        else:
            pytest.fail(f"the run ended without READY: {''.join(seen)[-2000:]}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    before = _losses("".join(seen))
    assert sorted(before) == list(range(10))

    # last.ckpt is a pointer to a committed tierstate checkpoint of the epoch-2 state (global step 8).
    pointer = _pointer(killed / "ckpt" / "last.ckpt")
    assert pointer["global_step"] == 8
    tier = FilesystemTier("nvme", killed / "tiers")
    assert pointer["step"] in tier.steps()
    # Parameters and AdamW state (6 + 18 tensors) were captured lazily; BatchNorm's buffers (3) and
    # ModelCheckpoint's score were copied before save_checkpoint returned.
    manifest = tier.manifest(pointer["step"])
    assert manifest.stats is not None and manifest.stats[0].eager_tensors == 4
    assert sum(1 for key in manifest.items if key.startswith(("state_dict/", "optimizer_states/0/"))) == 9 + 18

    resumed = _run(killed, 4, "--resume")
    assert sorted(resumed) == list(range(8, 16))
    assert resumed == {step: uninterrupted[step] for step in resumed}  # bit for bit
    assert before == {step: uninterrupted[step] for step in before}


def _io(tmp_path: Path, **config: object):
    from tierstate.integrations.lightning import TierstateCheckpointIO

    return TierstateCheckpointIO({"tiers": {"nvme": {"path": str(tmp_path / "tiers")}}, **config})


def test_save_writes_a_pointer_once_durable_and_load_gives_the_dict_back(tmp_path: Path) -> None:
    io = _io(tmp_path)
    weights = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3)}
    optimizer = {"state": {0: {"step": torch.tensor(40.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = {
        "epoch": 2, "global_step": 40, "state_dict": weights, "optimizer_states": [optimizer],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}}, "hparams_name": None,
    }  # fmt: skip
    io.save_checkpoint(state, tmp_path / "ckpt" / "a.ckpt")
    io.save_checkpoint({**state, "global_step": 41}, tmp_path / "ckpt" / "b.ckpt")
    io.remove_checkpoint(tmp_path / "ckpt" / "a.ckpt")
    io.wait()
    assert not (tmp_path / "ckpt" / "a.ckpt").exists()
    assert _pointer(tmp_path / "ckpt" / "b.ckpt")["step"] == 2  # the second save
    loaded = io.load_checkpoint(tmp_path / "ckpt" / "b.ckpt")
    io.teardown()
    assert loaded.keys() == state.keys() and loaded["global_step"] == 41 and loaded["hparams_name"] is None
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in weights.items())
    assert loaded["optimizer_states"][0]["state"][0]["step"] == 40 and loaded["loops"] == state["loops"]

    # A new plugin (a restart) numbers its saves after the newest on the tiers.
    again = _io(tmp_path)
    again.save_checkpoint(state, tmp_path / "ckpt" / "c.ckpt")
    again.teardown()
    assert _pointer(tmp_path / "ckpt" / "c.ckpt")["step"] == 3


def _flip_a_stored_byte(step_dir: Path) -> None:
    """One byte inside the first frame of the step's data file, flipped in place (its checksum now fails)."""
    from tierstate import read_manifest

    name, record = next(iter(read_manifest(step_dir).files.items()))
    frame = record.frames[0]
    with open(step_dir / name, "r+b") as f:
        f.seek(frame.offset + frame.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_load_passes_over_a_damaged_copy_to_the_next_tiers_and_refuses_when_none_reads_clean(tmp_path: Path) -> None:
    tiers = {"nvme": {"path": str(tmp_path / "nvme")}, "pfs": {"path": str(tmp_path / "pfs"), "flush": {"every": 1}}}
    io = _io(tmp_path, tiers=tiers)
    weights = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3)}
    io.save_checkpoint({"global_step": 7, "state_dict": weights}, tmp_path / "ckpt" / "a.ckpt")
    io.teardown()  # drains: the flush to pfs is done
    step = _pointer(tmp_path / "ckpt" / "a.ckpt")["step"]
    _flip_a_stored_byte(FilesystemTier("nvme", tmp_path / "nvme").step_dir(step))

    reader = _io(tmp_path, tiers=tiers)
    loaded = reader.load_checkpoint(tmp_path / "ckpt" / "a.ckpt")
    assert loaded["global_step"] == 7
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in weights.items())

    _flip_a_stored_byte(FilesystemTier("pfs", tmp_path / "pfs").step_dir(step))
    from tierstate.integrations.lightning import LightningCheckpointError

    with pytest.raises(LightningCheckpointError, match=r"no copy reads clean: tier nvme .*; tier pfs "):
        reader.load_checkpoint(tmp_path / "ckpt" / "a.ckpt")
    reader.teardown()


def test_a_torch_save_file_loads_as_torch_checkpoint_io_loads_it(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, tmp_path / "plain.ckpt")
    loaded = _io(tmp_path).load_checkpoint(tmp_path / "plain.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2)) and loaded["epoch"] == 1


def test_objects_msgpack_cannot_store_fail_the_save_unless_pickle_is_allowed(tmp_path: Path) -> None:
    from tierstate.integrations.lightning import LightningCheckpointError

    state = {"global_step": 1, "hyper_parameters": {"path": Path("/data")}}
    refusing = _io(tmp_path)
    with pytest.raises(LightningCheckpointError, match="'hyper_parameters'.*allow_pickle"):
        refusing.save_checkpoint(state, tmp_path / "a.ckpt")
    refusing.teardown()
    io = _io(tmp_path, policies={"allow_pickle": True})
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    io.wait()
    assert io.load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"] == {"path": Path("/data")}
    io.teardown()


@pytest.mark.slow
def test_a_run_started_fresh_on_old_checkpoints_is_the_one_last_resumes(tmp_path: Path) -> None:
    """Issue 27 item 3 for Lightning: an old run (3 epochs) left checkpoints on the tiers; a new run on the
    same tiers and directory, started without ckpt_path, numbers its saves after them (no collision) and
    its `last.ckpt` names its own; a later `ckpt_path="last"` resumes the new run (epoch 2 after its epoch 1),
    where the old run's last would have had nothing left to train."""
    root = tmp_path / "run"
    _run(root, 3)
    old = FilesystemTier("nvme", root / "tiers").steps()
    fresh = _run(root, 1)  # a fresh start: no ckpt_path
    assert sorted(fresh) == list(range(4))
    steps = FilesystemTier("nvme", root / "tiers").steps()
    assert steps[: len(old)] == old and len(steps) > len(old)  # the old run's kept, the new one's after them
    resumed = _run(root, 2, "--resume")
    assert sorted(resumed) == list(range(4, 8))  # the new run's epoch 2, resumed from its own epoch 1
    assert resumed == {step: bits for step, bits in _run(tmp_path / "whole", 2).items() if step >= 4}


def test_each_saves_figures_reach_the_lightning_loggers(tmp_path: Path) -> None:
    """tierstate/blocked_s, durable_s, gbps, bytes, failures go to the saving Trainer's loggers (a real
    CSVLogger here: its metrics.csv), one row per save, at the save's global step."""
    import csv

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from tierstate.integrations.lightning import TierstateCheckpointIO

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    io = TierstateCheckpointIO({"tiers": {"nvme": {"path": str(tmp_path / "tiers")}}})
    logger = L.pytorch.loggers.CSVLogger(tmp_path / "logs", name="run")
    trainer = L.Trainer(
        max_epochs=3, plugins=[io], logger=logger, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)],
        accelerator="cpu",
    )  # fmt: skip
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    with open(Path(logger.log_dir) / "metrics.csv") as rows:
        saves = [row for row in csv.DictReader(rows) if row.get("tierstate/step")]
    assert [int(float(row["tierstate/step"])) for row in saves] == [1, 2, 3]
    assert [int(row["step"]) for row in saves] == [2, 4, 6]  # each at the global step it saved
    for row in saves:
        assert float(row["tierstate/failures"]) == 0 and int(float(row["tierstate/bytes"])) > 0
        assert float(row["tierstate/blocked_s"]) > 0 and float(row["tierstate/durable_s"]) > 0


def test_load_from_checkpoint_on_a_pointer_says_what_to_do_and_the_helper_loads_it(tmp_path: Path) -> None:
    """``LightningModule.load_from_checkpoint`` reads a file with torch.load, which fails on tierstate's pointer
    (weights-only or not) with an error that says what to do instead of torch's advice to retry with
    ``weights_only=False``; ``tierstate.integrations.lightning.load_from_checkpoint`` loads it
    (hyperparameters and weights)."""
    from lightning_sized import Sized, sized_data, sized_trainer

    from tierstate.integrations.lightning import LOAD_HINT, load_from_checkpoint

    config = {"tiers": {"nvme": {"path": str(tmp_path / "tiers")}}}
    trained = Sized(width=5)
    sized_trainer(config, tmp_path / "ckpt", 1).fit(trained, sized_data())
    last = tmp_path / "ckpt" / "last.ckpt"
    assert _pointer(last)["load"] == LOAD_HINT
    assert "this file is a pointer to a tierstate checkpoint" in last.read_text()  # a text file: cat shows it
    for weights_only in (True, False):
        with pytest.raises(
            RuntimeError,
            match=r"this file is a pointer to a tierstate checkpoint.*load it with "
            r"tierstate\.integrations\.lightning\.load_from_checkpoint",
        ) as refused:
            Sized.load_from_checkpoint(last, weights_only=weights_only)
        assert "weights_only" not in str(refused.value)
    loaded = load_from_checkpoint(Sized, last, config)
    assert loaded.hparams.width == 5 and torch.equal(loaded.net.weight, trained.net.weight)
