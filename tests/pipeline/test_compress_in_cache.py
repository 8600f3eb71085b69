"""Compression inside the host cache: the frame is streamed back into the chunk's own slab.

What this must not break: chunks that do not shrink stay raw and intact (the shuffle overwrote
nothing that is not put back), compressible and incompressible chunks mix in one checkpoint, slabs
reused by the next checkpoint carry no bytes of the previous one into it, and the scratch slabs
come out of the configured cache size rather than on top of it.
"""

from __future__ import annotations

import os

import torch

from tierstate.providers import TensorDictProvider
from tierstate.tiers.format import codecs
from tierstate.tiers.reading.stored import load


def test_compress_into_round_trips_and_refuses_incompressible() -> None:
    for width, data in ((4, (torch.randn(1 << 18) * 0.02).view(torch.uint8)),
                        (2, (torch.randn(1 << 18) * 0.02).to(torch.bfloat16).view(torch.uint8)),
                        (1, torch.randint(0, 3, (1 << 20,), dtype=torch.uint8))):
        raw = data.clone()
        scratch = torch.empty(raw.numel(), dtype=torch.uint8)
        done = codecs.compress_into(memoryview(raw.numpy()), scratch, 3, 0, width)
        assert done is not None and done[0] < raw.numel() and done[1] == width
        back = codecs.decompress(bytes(raw[: done[0]].numpy()), "zstd", raw.numel(), done[1])
        assert bytes(back) == bytes(data.numpy())
    noise = torch.frombuffer(bytearray(os.urandom(1 << 20)), dtype=torch.uint8)
    for width in (1, 2, 4):
        raw = noise.clone()
        assert codecs.compress_into(memoryview(raw.numpy()), torch.empty_like(raw), 3, 0, width) is None
        assert torch.equal(raw, noise)


def test_mixed_chunks_and_reused_slabs_round_trip(make_runner) -> None:
    runner = make_runner(pipeline__stages__compress__codec="zstd", chunk_size="1MiB", host_cache__size="6MiB")
    assert runner.cache.scratch_count == 2 and runner.cache.slab_count == 4  # scratch is inside the 6 MiB
    tensors = {
        "weights": torch.randn(1 << 19) * 0.02,  # compressible (2 MiB: several chunks)
        "noise": torch.frombuffer(bytearray(os.urandom(3 << 19)), dtype=torch.uint8).clone(),  # incompressible
        "small": torch.arange(1000, dtype=torch.int64),
    }
    runner.register(t=TensorDictProvider(tensors))
    for step in (1, 2, 3):
        tensors["weights"].mul_(1.5)
        tensors["noise"][:64] = step  # the same bytes but for a prefix: stale slab bytes would show
        result = runner.checkpoint(step).result()
        assert result.stored_bytes < result.raw_bytes
        state = load(result.path)
        for key, tensor in tensors.items():
            assert torch.equal(state[f"t/{key}"], tensor), (step, key)
