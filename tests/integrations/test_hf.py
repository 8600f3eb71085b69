"""Hugging Face: the Trainer checkpointed and resumed through TierstateCallback, and model directories
exported for ``from_pretrained``. Real transformers, a tiny GPT-2 built from its config (no download)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from tierstate import ExistingCheckpointsError, ObjectProvider, RNGProvider, Runner  # noqa: E402
from tierstate.cli import main as cli  # noqa: E402
from tierstate.integrations.hf import TierstateCallback  # noqa: E402
from tierstate.integrations.hf_trainer import TrainerIntegrationError  # noqa: E402

WORKER = Path(__file__).with_name("hf_train_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _config(tiers: Path) -> dict:
    return {"tiers": {"nvme": {"path": str(tiers)}}, "host_cache": {"size": "64MiB"}}


def test_importing_tierstate_and_its_hf_module_imports_no_transformers():
    code = "import sys, tierstate, tierstate.integrations.hf; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- the Trainer --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_trainer_killed_mid_run_resumes_from_the_tiers_with_the_uninterrupted_losses_bit_for_bit(tmp_path):
    """Kill (SIGKILL) after step 10, checkpoint 8 durable; a plain rerun resumes in the second epoch, past
    the batches consumed, with the RNGs where they were: its losses and weights are the uninterrupted run's."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = subprocess.Popen(
        [sys.executable, WORKER, whole / "tiers", whole / "out.pt"], env=_env(), stdout=subprocess.DEVNULL
    )
    worker = [sys.executable, WORKER, killed / "tiers", killed / "out.pt"]
    held = subprocess.Popen(
        [*worker, "--hold-at", "10", "--durable", "8"],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout is not None
        lines = iter(held.stdout.readline, "")  # its log lines, then the one it waits after for the kill
        assert next((line.strip() for line in lines if line.startswith("durable")), None) == "durable 8"
    finally:
        held.kill()
        held.wait()
    assert held.returncode == -9
    assert not (killed / "out.pt").exists()
    subprocess.run(worker, env=_env(), check=True, stdout=subprocess.DEVNULL)
    assert uninterrupted.wait() == 0

    expected, resumed = torch.load(whole / "out.pt"), torch.load(killed / "out.pt")
    losses = [entry for entry in expected["log"] if "loss" in entry]
    assert len(losses) == 12
    assert [entry for entry in resumed["log"] if "loss" in entry] == losses  # loss, grad norm, lr, epoch, step
    assert expected["weights"].keys() == resumed["weights"].keys()
    for key, tensor in expected["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key
    steps = sorted(int(p.name.removeprefix("step-")) for p in (killed / "tiers").glob("step-*"))
    assert steps == [4, 8, 12]

    # The Trainer's last checkpoint as a model directory: from_pretrained gets the trained weights.
    model_dir = tmp_path / "gpt2"
    assert _export(killed / "tiers", model_dir, "--provider", "model", step=12) == 0
    shutil.copy(killed / "config.json", model_dir)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected["weights"][key]), key


def _trainer(tmp_path: Path, callbacks: list) -> transformers.Trainer:
    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-output"),
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.Trainer(model=_tiny_gpt2(), args=args, train_dataset=dataset, callbacks=callbacks)


def test_the_callback_refuses_what_it_cannot_resume(tmp_path):
    with pytest.raises(ValueError, match="every"):
        TierstateCallback(every=0)

    late = _trainer(tmp_path, [])
    late.add_callback(TierstateCallback(_config(tmp_path / "late"), every=1))
    with pytest.raises(TrainerIntegrationError, match=r"Trainer\(callbacks=\[\.\.\.\]\)"):
        late.train()

    foreign = tmp_path / "foreign"  # a checkpoint of another program on the callback's tiers
    runner = Runner.from_dict(_config(foreign))
    runner.register(model=_tiny_gpt2(), counters=ObjectProvider({"step": 3}))
    runner.checkpoint(3).result()
    runner.close()
    trainer = _trainer(tmp_path, [TierstateCallback(_config(foreign), every=1)])
    with pytest.raises(TrainerIntegrationError, match="not written by TierstateCallback"):
        trainer.train()
    assert trainer.state.global_step == 0  # nothing trained over it


# --- model directories --------------------------------------------------------------------------
@pytest.fixture
def trained(tmp_path) -> tuple[transformers.GPT2LMHeadModel, Path]:
    """A tiny GPT-2 after one AdamW step, checkpointed with its optimizer and the RNGs at step 1."""
    model = _tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 100, (2, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    runner = Runner.from_dict(_config(tmp_path / "tiers"))
    runner.register(model=model, optim=optimizer, rng=RNGProvider())
    runner.checkpoint(1).result()
    runner.close()
    return model, tmp_path / "tiers"


def _export(tiers: Path, out: Path, *options: str, step: int = 1) -> int:
    return cli(["export", str(step), str(out), "--format", "hf", "--tier", f"nvme={tiers}", *options])


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("model*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_an_hf_export_loads_with_from_pretrained_with_no_missing_or_unexpected_keys_bit_exact(trained, tmp_path, shard):
    model, tiers = trained
    out = tmp_path / "gpt2"
    assert _export(tiers, out, "--provider", "model", *(["--max-shard-size", shard] if shard else [])) == 0
    model.config.save_pretrained(out)  # the user's part: the architecture

    index = out / "model.safetensors.index.json"
    if shard is None:
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    else:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(p.name for p in out.glob("model-*.safetensors"))
        assert len(shards) > 1 and set(weight_map.values()) == set(shards)
    stored = _files(out)
    live = model.state_dict()
    # The model's own names, the tied output layer once (under the embedding), nothing of the optimizer or RNG.
    assert set(stored) == set(live) - {"lm_head.weight"}

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert loaded.state_dict().keys() == live.keys()
    for key, tensor in live.items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_an_hf_export_names_the_providers_when_asked_for_one_that_is_not_there(trained, tmp_path, capsys):
    _, tiers = trained
    out = tmp_path / "gpt2"
    assert _export(tiers, out, "--provider", "modle") == 2
    assert "no provider 'modle' (providers: model, optim, rng)" in capsys.readouterr().err
    assert _export(tiers, out) == 2
    assert "give --provider NAME" in capsys.readouterr().err
    assert _export(tiers, out, "--provider", "rng") == 1  # objects, not weights: named, nothing written
    assert "holds objects (python" in capsys.readouterr().out
    assert not out.exists() or not any(out.iterdir())

    assert _export(tiers, out, "--provider", "model", "--max-shard-size", "40KB") == 0
    assert _export(tiers, out, "--provider", "model") == 2  # an earlier export is replaced only with --force
    assert "exists; give --force" in capsys.readouterr().err
    assert _export(tiers, out, "--provider", "model", "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # the stale shards and index are gone


def _lr_trainer(tmp_path: Path, tiers: Path, lr: float, max_steps: int, **callback: object) -> transformers.Trainer:
    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-output"), max_steps=max_steps, per_device_train_batch_size=2,
        learning_rate=lr, lr_scheduler_type="linear", save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    return transformers.Trainer(
        model=_tiny_gpt2(), args=args, train_dataset=dataset,
        callbacks=[TierstateCallback(_config(tiers), every=1, **callback)],
    )  # fmt: skip


def test_a_run_started_fresh_is_the_one_a_later_resume_finds(tmp_path):
    """An old run (lr 1e-3) left steps 1-4; a new run (lr 5e-4) started with resume_from_checkpoint=False
    stops ("crashes") after step 2; a plain train() then resumes the NEW run at step 2, its own schedule."""
    tiers = tmp_path / "tiers"
    _lr_trainer(tmp_path, tiers, 1e-3, 4).train()
    fresh = _lr_trainer(tmp_path, tiers, 5e-4, 2)
    fresh.train(resume_from_checkpoint=False)  # its checkpoints 1 and 2 no longer collide with the old run's
    assert fresh.state.global_step == 2
    steps = Runner.from_dict(_config(tiers))
    try:
        assert steps.steps() == {"nvme": [1, 2]}
    finally:
        steps.close()
    [aside] = [p for p in tiers.iterdir() if p.name.startswith("set-aside-")]
    assert sorted(p.name for p in aside.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]  # kept

    def lrs(trainer: transformers.Trainer) -> list[float]:
        return [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]

    assert lrs(fresh) == [5e-4, 2.5e-4]  # the old run logged [1e-3, 7.5e-4, 5e-4, 2.5e-4]
    resumed = _lr_trainer(tmp_path, tiers, 5e-4, 4)
    resumed.train()
    assert resumed.state.global_step == 4
    assert lrs(resumed)[:2] == lrs(fresh) and len(lrs(resumed)) == 4  # the new run's history, two steps on


def test_a_fresh_start_can_be_refused_instead(tmp_path):
    tiers = tmp_path / "tiers"
    _lr_trainer(tmp_path, tiers, 1e-3, 2).train()
    fresh = _lr_trainer(tmp_path, tiers, 5e-4, 2, on_fresh_start="refuse")
    with pytest.raises(ExistingCheckpointsError, match=r"earlier run's checkpoints \(nvme .*: steps \[1, 2\]\)"):
        fresh.train(resume_from_checkpoint=False)
    assert fresh.state.global_step == 0


def test_each_checkpoints_figures_reach_the_trainers_own_log(tmp_path):
    """tierstate/blocked_s, durable_s, gbps, bytes, failures in state.log_history (whence TensorBoard, W&B,
    MLflow get them through the Trainer's reporting callbacks), one entry per checkpoint, at its step."""
    trainer = _lr_trainer(tmp_path, tmp_path / "tiers", 1e-3, 4)
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "tierstate/step" in entry]
    assert [entry["tierstate/step"] for entry in entries] == [1, 2, 3, 4]
    for entry in entries:
        assert entry["tierstate/failures"] == 0 and entry["tierstate/bytes"] > 300_000  # the tiny GPT-2 and AdamW
        assert entry["tierstate/blocked_s"] > 0 and entry["tierstate/durable_s"] > 0 and entry["tierstate/gbps"] > 0
    assert [entry for entry in trainer.state.log_history if "loss" in entry]  # the Trainer's own entries unchanged


def test_a_resume_the_user_did_not_ask_for_is_said_at_the_default_level(tmp_path, caplog):
    tiers = tmp_path / "tiers"
    _lr_trainer(tmp_path, tiers, 1e-3, 2).train()
    caplog.set_level(logging.WARNING)  # Python's default level
    _lr_trainer(tmp_path, tiers, 1e-3, 3).train()
    said = [r.getMessage() for r in caplog.records if r.name == "tierstate" and "resuming" in r.getMessage()]
    assert len(said) == 1 and f"resuming from step 2 (tier nvme, {tiers / 'step-2'})" in said[0]
    assert "resume_from_checkpoint=False" in said[0]
