"""Checkpoint -> restore through the real pipeline and real files: every dtype, every provider."""

from __future__ import annotations

import random

import pytest
import torch

from tierstate.providers import (
    CompositeProvider,
    ModuleProvider,
    ObjectProvider,
    OptimizerProvider,
    RNGProvider,
    StatefulProvider,
    TensorDictProvider,
)
from tierstate.tiers.format.dtypes import DTYPES
from tierstate.tiers.format.format import read_manifest
from tierstate.tiers.reading.stored import load


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for every dtype, including those torch.equal does not implement (float8, bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _random_bytes_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _scramble(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.reshape(-1).view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_every_dtype_round_trips_bit_exactly(make_runner, codec):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{name}": _random_bytes_tensor(dtype, (5, 7), gen) for name, dtype in sorted(DTYPES.items())}
    tensors["bf16_scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.empty(0, 4)
    tensors["empty_int"] = torch.empty(3, 0, dtype=torch.int64)
    expected = {k: v.reshape(-1).view(torch.uint8).clone().view(v.dtype).reshape(v.shape) for k, v in tensors.items()}
    runner = make_runner(pipeline__stages__compress__codec=codec)
    runner.register(t=TensorDictProvider(tensors))
    runner.checkpoint(1).result()
    _scramble(tensors)
    assert not _same(tensors["float32"], expected["float32"])
    runner.restore(1)
    for key, value in expected.items():
        assert _same(tensors[key], value), key


def test_non_contiguous_views_round_trip(make_runner):
    base = torch.arange(4 * 6 * 5, dtype=torch.float64).reshape(4, 6, 5)
    views = {
        "transposed": base.transpose(0, 2),
        "strided": base[:, ::2, 1::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "bf16_t": base.to(torch.bfloat16).permute(2, 0, 1),
    }
    runner = make_runner()

    class Views:
        def describe(self):
            return TensorDictProvider(views).describe()

        def restore(self, state):
            self.state = dict(state)

    provider = Views()
    runner.register(v=provider)
    runner.checkpoint(3).result()
    runner.restore(3)
    for key, view in views.items():
        assert provider.state[key].is_contiguous()
        assert torch.equal(provider.state[key], view), key


def test_tied_weights_are_stored_once_and_restored_shared(make_runner, tmp_path):
    emb = torch.nn.Embedding(64, 16)
    head = torch.nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    runner = make_runner()
    runner.register(model=ModuleProvider(model))
    result = runner.checkpoint(0).result()
    assert result.raw_bytes < 64 * 16 * 4 * 2  # the tied tensor is written once
    expected = emb.weight.detach().clone()
    with torch.no_grad():
        emb.weight.zero_()
    runner.restore(0)
    assert torch.equal(head.weight, expected) and head.weight is emb.weight
    plain = load(result.path)
    assert plain["model/head.weight"] is plain["model/emb.weight"]


def _train_step(model, opt, sched=None):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def test_all_providers_round_trip_nested(make_runner):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counters = {"step": 3, "tokens": 12_000, "name": "run-a", "history": [1.5, 2.5]}
    for _ in range(3):
        _train_step(model, opt, sched)
    runner = make_runner()
    runner.register(
        train=CompositeProvider(
            model=ModuleProvider(model), optim=OptimizerProvider(opt), sched=StatefulProvider(sched)
        ),
        rng=RNGProvider(),
        counters=ObjectProvider(counters),
    )
    runner.attach(opt)
    runner.checkpoint(3).result()
    after_rng = (random.random(), torch.rand(3))
    params = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    lr = sched.get_last_lr()
    for _ in range(3):
        _train_step(model, opt, sched)
    counters.update(step=6, name="changed")
    runner.restore("latest")
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in opt.state[model[0].weight].items())
    assert sched.get_last_lr() == lr and counters["step"] == 3 and counters["name"] == "run-a"
    assert random.random() == after_rng[0] and torch.equal(torch.rand(3), after_rng[1])


def test_load_returns_plain_state_without_runner(make_runner):
    model = torch.nn.Linear(3, 2)
    runner = make_runner()
    runner.register(model=ModuleProvider(model), meta=ObjectProvider({"epoch": 7}))
    path = runner.checkpoint(11).result().path
    plain = load(path)
    assert set(plain) == {"model/weight", "model/bias", "meta/value"}
    assert torch.equal(plain["model/weight"], model.weight.detach()) and plain["meta/value"] == {"epoch": 7}


def test_compression_shrinks_compressible_state(make_runner):
    tensors = {"zeros": torch.zeros(1 << 20), "ramp": torch.arange(1 << 18, dtype=torch.int32)}
    runner = make_runner(pipeline__stages__compress__codec="zstd")
    runner.register(t=TensorDictProvider(tensors))
    result = runner.checkpoint(1).result()
    assert result.stored_bytes < result.raw_bytes / 5
    expected = {k: v.clone() for k, v in tensors.items()}
    _scramble(tensors)
    runner.restore(1)
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())


def test_byte_shuffle_makes_bf16_weights_smaller_and_round_trips(make_runner, tmp_path):
    weights = {"w": torch.randn(1 << 21, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    expected = weights["w"].clone()
    stored = {}
    for mode in ("off", "auto"):
        runner = make_runner(
            pipeline__stages__compress__codec="zstd", pipeline__stages__compress__shuffle=mode, chunk_size="1MiB"
        )
        runner.register(t=TensorDictProvider(weights))
        result = runner.checkpoint(1 if mode == "off" else 2).result()
        stored[mode] = result.stored_bytes
        frames = [frame for file in read_manifest(result.path).files.values() for frame in file.frames]
        assert {f.shuffle for f in frames} == ({1} if mode == "off" else {2})
        weights["w"].zero_()
        runner.restore(result.step)
        assert torch.equal(weights["w"], expected)
        runner.close()  # one writer per tier: the next mode's runner takes it
    assert stored["auto"] < stored["off"] < expected.numel() * 2

