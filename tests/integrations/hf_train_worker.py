"""A Hugging Face Trainer run with TierstateCallback, as a user writes it, in a process of its own.

``python hf_train_worker.py TIERS OUT [--hold-at STEP --durable STEP]``: trains a tiny GPT-2 (no
download) for 2 epochs of 6 steps, with dropout and shuffled batches, checkpointing every 4 steps to
the tier directory TIERS; writes the log history and the final weights to OUT (torch.save), the
model's ``config.json`` beside it.
With ``--hold-at H --durable D``, once step H is done it waits for checkpoint D to be durable, prints
``durable D`` and blocks on stdin: the test kills it there (SIGKILL), then runs it again.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tierstate.integrations.hf import TierstateCallback


class Tokens(torch.utils.data.Dataset):
    """24 sequences of 16 random token ids, the same in every process."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 100, (24, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HoldOnceDurable(TrainerCallback):
    """The test's hook: after step ``hold_at``, say that checkpoint ``durable`` is on disk, then wait to be killed."""

    def __init__(self, tierstate: TierstateCallback, hold_at: int, durable: int) -> None:
        self.tierstate, self.hold_at, self.durable = tierstate, hold_at, durable

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.hold_at:
            return
        handle = self.tierstate.handle
        assert handle is not None and handle.step == self.durable, handle
        handle.result()  # raises if that checkpoint failed
        print(f"durable {self.durable}", flush=True)
        sys.stdin.readline()  # killed here
        raise SystemExit("not killed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tiers")
    parser.add_argument("out")
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--durable", type=int)
    options = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tiers = {"tiers": {"nvme": {"path": options.tiers}}, "host_cache": {"size": "64MiB"}}
    tierstate = TierstateCallback(tiers, every=4)
    callbacks: list[TrainerCallback] = [tierstate]
    if options.hold_at is not None:
        callbacks.append(HoldOnceDurable(tierstate, options.hold_at, options.durable))
    args = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(options.out), "hf-output"),
        num_train_epochs=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=7,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    torch.save({"log": trainer.state.log_history, "weights": model.state_dict()}, options.out)
    config.to_json_file(os.path.join(os.path.dirname(options.out), "config.json"))  # for from_pretrained


if __name__ == "__main__":
    main()
