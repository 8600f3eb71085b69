"""What every benchmark shares: the machine's facts, the disk's own limits, the states, the competitors.

Each benchmark script runs tierstate and its competitors (``torch.save``, PyTorch DCP ``save`` and
``async_save``) in ONE process on the SAME state, interleaved A B A B, so that the noise of a shared
machine hits all of them alike and the ratios mean something. Everything that would otherwise be
written twice lives here: one :class:`Checkpointer` per method with one interface (save, the wait
before ``optimizer.step()``, wait until durable, restore), the disk probes that give the hardware's
limit in the same run, the example GPT sized by preset, and the report (a rich table on stdout, the
raw numbers as JSON for RESULTS.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as `python benchmarks/x.py`: make `benchmarks` and `examples` importable
    sys.path.insert(0, str(REPO_ROOT))

from examples.gpt import GPT, GPTConfig, TokenStream  # noqa: E402
from tierstate.pipeline.runner import Runner  # noqa: E402
from tierstate.providers import ModuleProvider, OptimizerProvider, TensorDictProvider  # noqa: E402
from tierstate.tiers.filesystem import fsync_dir  # noqa: E402

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BENCH_ROOT = REPO_ROOT / "checkpoints"

# Without CUDA, DCP's pinned memory and non-blocking copies are unavailable (its DefaultStager raises
# when asked for them), so its best CPU configuration is: plain memory, staging in a background thread.
CUDA = torch.cuda.is_available()
# DCP says so on every call without a process group; single-process saving is exactly what we ask for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --- small utilities ---------------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def interleave(names: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """A B C A B C ...: every method sees every phase of the machine's background noise."""
    for repeat in range(repeats):
        for name in names:
            yield repeat, name


def load_average() -> float:
    return os.getloadavg()[0]


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def settle() -> None:
    """Write back other dirty pages first, so one method's writeback is not billed to the next."""
    os.sync()


def drop_caches() -> bool:
    """Empty the page cache for cold reads; False where not permitted (not root, in a container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --- memory ------------------------------------------------------------------------------------------
def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """VmHWM: the kernel's exact high-water mark of resident memory, no sampling gaps."""
    return _status_kib("VmHWM") * 1024


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so a baseline RSS holds no free
    memory that a later allocation could reuse without showing up in the peak."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5), so a peak can be taken per phase."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


# --- machine facts -----------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_facts(directory: Path) -> dict[str, str]:
    """The facts RESULTS.md needs to make the numbers reproducible: CPU, memory, disk, software."""
    lscpu = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in _run(["lscpu"]).splitlines()) if v
    )
    mem = _run(["free", "-g"]).splitlines()
    directory.mkdir(parents=True, exist_ok=True)
    df = _run(["df", "-hT", str(directory)]).splitlines()
    return {
        "cpu": f"{lscpu.get('Model name', platform.processor())}, {os.cpu_count()} cores "
        f"({lscpu.get('Hypervisor vendor', 'bare metal')})",
        "memory": mem[1] if len(mem) > 1 else "?",
        "disk": df[-1] if df else "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "threads": str(torch.get_num_threads()),
        "load_avg_start": f"{load_average():.2f}",
    }


def warn_if_busy(limit: float = 1.5) -> None:
    load = load_average()
    if load > limit:
        print(f"warning: load average {load:.2f} > {limit}: other work is running, timings will be noisy",
              file=sys.stderr)


# --- the disk's own limits ---------------------------------------------------------------------------
def _random_block(nbytes: int) -> mmap.mmap:
    """A page-aligned (O_DIRECT-ready) block of random bytes, so no layer can compress or dedupe it."""
    block = mmap.mmap(-1, nbytes)
    block.write(os.urandom(nbytes))
    return block


def disk_write_seconds(path: Path, nbytes: int, direct: bool, block_size: int = 64 * MiB) -> float:
    """Seconds to write ``nbytes`` sequentially to a new file and fsync it (O_DIRECT or buffered)."""
    block = _random_block(block_size)
    nbytes = -(-nbytes // 4096) * 4096  # O_DIRECT writes whole 4 KiB blocks
    path.unlink(missing_ok=True)
    settle()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    started = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        offset = 0
        with memoryview(block) as view:
            while offset < nbytes:
                offset += os.pwrite(fd, view[: min(block_size, nbytes - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    elapsed = time.perf_counter() - started
    block.close()
    return elapsed


def disk_read_seconds(path: Path, direct: bool, block_size: int = 64 * MiB) -> float:
    """Seconds to read ``path`` sequentially: cold page cache (dropped first) or O_DIRECT."""
    block = mmap.mmap(-1, block_size)
    if not direct:
        drop_caches()
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        offset = 0
        while got := os.preadv(fd, [block], offset):
            offset += got
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    block.close()
    return elapsed


# --- states ------------------------------------------------------------------------------------------
# GPT shapes by preset; "full" is the size: params + AdamW's two moments ~1.5 GB.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64),                  # ~0.5 M params, ~6 MB
    "small": GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=64),                 # ~3 M params, ~40 MB
    "medium": GPTConfig(d_model=512, n_layers=8, n_heads=8, seq_len=64),                # ~25 M params, ~0.3 GB
    "full": GPTConfig(d_model=1024, n_layers=10, n_heads=16, seq_len=64, dropout=0.1),  # ~126 M params, ~1.5 GB
}


@dataclass
class GPTState:
    """The example GPT, its AdamW and its data: the "real training state" every method saves."""

    model: GPT
    optimizer: torch.optim.AdamW
    data: TokenStream
    steps_done: int = 0
    device: torch.device = torch.device("cpu")

    def train_step(self, before_step: Callable[[], object] | None = None) -> float:
        """One forward/backward/step; ``before_step`` runs where an async checkpointer may have to wait."""
        x, y = next(self.data)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        _, loss = self.model(x, y)
        assert loss is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if before_step is not None:
            before_step()
        self.optimizer.step()
        self.steps_done += 1
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        """The same content tierstate's providers describe: model state dict + optimizer state dict."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def providers(self) -> dict[str, Any]:
        return {"model": ModuleProvider(self.model), "optim": OptimizerProvider(self.optimizer)}

    @property
    def tensor_bytes(self) -> int:
        return state_tensor_bytes(self.state_dict())

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def digest(self) -> float:
        """A cheap fingerprint of every parameter and moment, to check that a restore really restored."""
        return sum(float(t.sum()) for t in _tensors(self.state_dict()) if t.is_floating_point())

    def scramble(self) -> None:
        """Overwrite every parameter and moment, so a restore that loads nothing is caught."""
        with torch.no_grad():
            for tensor in _tensors(self.state_dict()):
                if tensor.is_floating_point():
                    tensor.fill_(0.5)


def build_gpt(
    preset: str | GPTConfig,
    batch_size: int = 4,
    warm_steps: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> GPTState:
    """The example model at ``preset`` size, trained ``warm_steps`` so AdamW's moments exist and are real."""
    torch.manual_seed(seed)
    config = GPT_PRESETS[preset] if isinstance(preset, str) else preset
    device = torch.device(device)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.95))
    state = GPTState(model, optimizer, TokenStream(batch_size, config.seq_len, seed=seed), device=device)
    for _ in range(warm_steps):
        state.train_step()
    state.optimizer.zero_grad(set_to_none=True)  # gradients are not checkpointed; do not count them as state
    return state


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


def state_tensor_bytes(state: Any) -> int:
    """Tensor bytes of a state, counting shared storage (tied weights) once, as every method stores it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in _tensors(state):
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident not in seen:
            seen.add(ident)
            total += t.numel() * t.element_size()
    return total


@dataclass
class DictState:
    """A synthetic state (``{name: tensor}``) with the same interface as :class:`GPTState` for saving."""

    tensors: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, t in self.tensors.items():
            t.copy_(state["tensors"][key])

    def providers(self) -> dict[str, Any]:
        return {"tensors": TensorDictProvider(self.tensors)}

    @property
    def tensor_bytes(self) -> int:
        return state_tensor_bytes(self.tensors)


def synthetic_state(total_bytes: int, tensor_bytes: int, dtype: torch.dtype = torch.float32) -> DictState:
    """``total_bytes`` of weight-like values (normal, std 0.02) in tensors of ``tensor_bytes`` each."""
    element = torch.empty((), dtype=dtype).element_size()
    count = max(1, total_bytes // tensor_bytes)
    numel = max(1, tensor_bytes // element)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(count):
        tensors[f"t{i:05d}"] = (torch.randn(numel, generator=generator) * 0.02).to(dtype)
    return DictState(tensors)


def cache_for(state_bytes: int, chunk: int = 16 * MiB) -> int:
    """A host cache that holds the whole state (+6% and 8 chunks for the tails of tensors split across
    chunks), so capture never waits for persist: the setting the blocked-time benchmarks use."""
    return (int(state_bytes * 1.06) // chunk + 8) * chunk


# --- the competitors ---------------------------------------------------------------------------------
@dataclass
class Record:
    """One checkpoint as a trainer experiences it."""

    step: int
    requested: float  # perf_counter when asked
    blocked_s: float = 0.0  # training time lost to it: the call itself + any wait before optimizer.step
    durable_at: float | None = None  # perf_counter when all bytes were fsync'd and committed

    @property
    def durable_s(self) -> float:
        return (self.durable_at or float("nan")) - self.requested


class Checkpointer:
    """One checkpointing method behind one interface, so the benchmarks treat all of them alike.

    ``save`` is called right after ``optimizer.step()``; ``before_step`` right before the next
    ``optimizer.step()`` (where a lazy or asynchronously staging method must have copied the state);
    ``drain`` waits until everything requested is durable. Times spent in ``save`` and
    ``before_step`` are what training loses; ``records`` holds one :class:`Record` per checkpoint.
    """

    name = "none"
    # The pinned / shared-memory options of DCP only exist with CUDA; subclasses describe their setup.
    setup = ""

    def __init__(self, state: Any, root: Path) -> None:
        self.state = state
        self.root = root
        self.records: list[Record] = []

    def save(self, step: int) -> Record:
        record = Record(step, time.perf_counter())
        self._save(record)
        record.blocked_s += time.perf_counter() - record.requested
        self.records.append(record)
        return record

    def _save(self, record: Record) -> None:
        record.durable_at = time.perf_counter()

    def before_step(self) -> float:
        return 0.0

    def wait_staged(self) -> float:
        """Wait until the state may change again (captured / staged); seconds waited."""
        return self.before_step()

    @staticmethod
    def _wait(future: concurrent.futures.Future[Any] | None) -> float:
        """Seconds spent waiting for ``future`` (none when it is None or done)."""
        if future is None or future.done():
            return 0.0
        started = time.perf_counter()
        future.result()
        return time.perf_counter() - started

    def _block_on(self, future: concurrent.futures.Future[Any] | None) -> float:
        """Wait for ``future`` (the state's copy) before the optimizer steps; the seconds count as the
        latest checkpoint's blocked time."""
        waited = self._wait(future)
        if waited and self.records:
            self.records[-1].blocked_s += waited
        return waited

    def drain(self) -> float:
        return 0.0

    def restore(self, step: int) -> None:
        raise NotImplementedError

    def stored_bytes(self, step: int) -> int:
        path = self.path(step)
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def clear(self) -> None:
        """Delete this method's checkpoints (between runs; never timed)."""
        self.drain()
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)

    def close(self) -> None:
        self.drain()


class NoCheckpoint(Checkpointer):
    """The baseline a slowdown is measured against: the same loop, no checkpoint."""

    name = "none"

    def save(self, step: int) -> Record:
        return Record(step, time.perf_counter(), 0.0, time.perf_counter())


class TierstateCheckpointer(Checkpointer):
    """tierstate's runner: lazy capture into the host cache, O_DIRECT persist, manifest commit.

    The runner's optimizer step pre-hook (``runner.attach``) does the only wait a trainer sees; its
    seconds land in ``handle.blocked_s``, which is read back into the record once the step is done.
    """

    name = "tierstate"

    def __init__(
        self,
        state: Any,
        root: Path,
        cache_bytes: int,
        chunk_bytes: int = 16 * MiB,
        codec: str = "none",
        level: int = 1,
        bandwidth: int | None = None,
        io: str = "auto",
        yaml_path: Path = DEFAULT_YAML,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__(state, root)
        overrides: dict[str, Any] = {
            "tiers": {"nvme": {"path": str(root)}},
            "chunk_size": chunk_bytes,
            "host_cache.size": cache_bytes,
            "pipeline.stages.compress.codec": codec,
            "pipeline.stages.compress.level": level,
            "pipeline.stages.persist.bandwidth": bandwidth,
            "pipeline.stages.persist.io": io,
        }
        self.runner = Runner.from_yaml(yaml_path, overrides)
        self.runner.register(**state.providers())
        if optimizer is not None:
            self.runner.attach(optimizer)
        self._handles: dict[int, Any] = {}
        self.setup = f"host cache {cache_bytes / GiB:.2f} GiB, chunk {chunk_bytes // MiB} MiB, codec {codec}"
        if bandwidth:
            self.setup += f", persist throttled to {bandwidth / 1e6:.0f} MB/s"

    def _save(self, record: Record) -> None:
        self._handles[record.step] = self.runner.checkpoint(record.step)

    def before_step(self) -> float:
        return 0.0  # the runner's own step pre-hook waits; its time is in handle.blocked_s

    def wait_staged(self) -> float:
        return self.runner.wait_captured()

    def drain(self) -> float:
        started = time.perf_counter()
        self.runner.wait()
        for record in self.records:
            handle = self._handles.get(record.step)
            if handle is None or record.durable_at is not None:
                continue
            result = handle.result()
            record.blocked_s = handle.blocked_s  # the call + the pre-hook's waits, measured by the runner
            record.durable_at = record.requested + result.durable_s
        return time.perf_counter() - started

    def result(self, step: int) -> Any:
        return self._handles[step].result()

    def restore(self, step: int) -> None:
        self.runner.restore(step)

    def close(self) -> None:
        self.drain()
        self.runner.close()


class TorchSaveCheckpointer(Checkpointer):
    """``torch.save`` of the state dict to a temp file, fsync, rename, fsync the directory: synchronous."""

    name = "torch.save"

    def __init__(self, state: Any, root: Path, mmap_load: bool = False) -> None:
        super().__init__(state, root)
        self.mmap_load = mmap_load
        self.setup = "sync, fsync + atomic rename"

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}.pt"

    def _save(self, record: Record) -> None:
        final = self.path(record.step)
        partial = final.with_suffix(".partial")
        with open(partial, "wb") as f:
            torch.save(self.state.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, final)
        fsync_dir(self.root)
        record.durable_at = time.perf_counter()

    def restore(self, step: int) -> None:
        loaded = torch.load(self.path(step), map_location="cpu", weights_only=True, mmap=self.mmap_load)
        self.state.load_state_dict(loaded)
        if self.mmap_load:
            # The optimizer keeps the loaded tensors, which mmap leaves file-backed: nothing is read until
            # the next optimizer.step() touches them. Touch one element per page so the timing includes the
            # reads (the restore is complete), as it does for every other method.
            for tensor in _tensors(loaded):
                if tensor.numel():
                    float(tensor.reshape(-1)[:: max(1, 4096 // tensor.element_size())].float().sum())


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


class DCPSaveCheckpointer(Checkpointer):
    """PyTorch DCP ``save`` (FileSystemWriter, sync_files=True), single process: synchronous."""

    name = "dcp.save"
    setup = "sync, FileSystemWriter(sync_files=True)"

    def _save(self, record: Record) -> None:
        _dcp().save(self.state.state_dict(), checkpoint_id=str(self.path(record.step)), no_dist=True)
        record.durable_at = time.perf_counter()

    def restore(self, step: int) -> None:
        # DCP loads in place into the tensors of the given state dict, then the usual load_state_dict.
        state = self.state.state_dict()
        _dcp().load(state, checkpoint_id=str(self.path(step)), no_dist=True)
        self.state.load_state_dict(state)


class DCPAsyncCheckpointer(Checkpointer):
    """PyTorch DCP ``async_save``: stage a CPU copy, then write it on a background thread.

    ``staging="sync"`` is DCP's default (the call copies the whole state before returning);
    ``staging="async"`` passes a reused ``DefaultStager`` that stages in a background thread, so the
    trainer waits for the copy only before its next ``optimizer.step()`` -- the same overlap tierstate
    uses. Without CUDA, pinned memory and non-blocking copies do not exist (DefaultStager refuses
    them), so both run on plain memory. As DCP's docs ask, a new save first waits for the previous one.
    """

    def __init__(self, state: Any, root: Path, staging: str = "async") -> None:
        super().__init__(state, root)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.staging = staging
        self.name = "dcp.async_save" + ("+async-staging" if staging == "async" else "")
        self._stager = None
        if staging == "async":
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=CUDA, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=CUDA
                )
            )
            self.setup = f"DefaultStager reused: async staging, pinned={CUDA}, non-blocking={CUDA}"
        else:
            self.setup = "default stager: synchronous staging copy"
        self._staged: Any = None  # future: staging done
        self._upload: Any = None  # future: durable
        self._lock = threading.Lock()

    def _save(self, record: Record) -> None:
        if self._upload is not None:
            self._upload.result()  # one in flight, as with tierstate's `in_flight: wait`
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            response = _dcp().async_save(
                self.state.state_dict(),
                checkpoint_id=str(self.path(record.step)),
                no_dist=True,
                async_stager=self._stager,
            )
        if hasattr(response, "upload_completion"):
            self._staged, self._upload = response.staging_completion, response.upload_completion
        else:
            self._staged, self._upload = None, response

        def done(_future: Any, record: Record = record) -> None:
            record.durable_at = time.perf_counter()

        self._upload.add_done_callback(done)

    def before_step(self) -> float:
        return self._block_on(self._staged)

    def drain(self) -> float:
        return self._wait(self._upload)

    def restore(self, step: int) -> None:
        state = self.state.state_dict()
        _dcp().load(state, checkpoint_id=str(self.path(step)), no_dist=True)
        self.state.load_state_dict(state)

    def close(self) -> None:
        self.drain()
        if self._stager is not None:
            self._stager.close()


class CopyFloorCheckpointer(Checkpointer):
    """Not a checkpointer but the least any snapshotting asynchronous one must do on the CPU: copy
    the state once into preallocated host memory, on one background thread (numpy's single-threaded
    memcpy, as tierstate's capture), with no checksum and no I/O. Its slowdown is the floor against
    which tierstate's own overhead is read; its "durable after" is when the copy ended."""

    name = "copy-floor"

    def __init__(self, state: Any, root: Path) -> None:
        super().__init__(state, root)
        self._sources = [t.detach() for t in _tensors(state.state_dict())]
        self._buffers = [torch.zeros_like(t) for t in self._sources]  # zeros: pages faulted in now
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy-floor")
        self._copied: concurrent.futures.Future[None] | None = None
        self.setup = "one background thread, np.copyto of every tensor into a reused buffer; nothing written"

    def _copy(self, record: Record) -> None:
        for src, dst in zip(self._sources, self._buffers, strict=True):
            np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
        record.durable_at = time.perf_counter()

    def _save(self, record: Record) -> None:
        self._copied = self._pool.submit(self._copy, record)

    def before_step(self) -> float:
        return self._block_on(self._copied)

    def drain(self) -> float:
        return self._wait(self._copied)

    def close(self) -> None:
        self.drain()
        self._pool.shutdown()


def make_checkpointer(name: str, state: Any, root: Path, **tierstate: Any) -> Checkpointer:
    """A method by name; ``tierstate`` keyword arguments go to :class:`TierstateCheckpointer`."""
    directory = root / "".join(c if c.isalnum() or c in "._-" else "-" for c in name)
    directory.mkdir(parents=True, exist_ok=True)
    if name == "none":
        return NoCheckpoint(state, directory)
    if name.startswith("tierstate"):
        ckpt = TierstateCheckpointer(state, directory, **tierstate)
        ckpt.name = name
        return ckpt
    if name == "copy-floor":
        return CopyFloorCheckpointer(state, directory)
    if name == "torch.save":
        return TorchSaveCheckpointer(state, directory)
    if name == "dcp.save":
        return DCPSaveCheckpointer(state, directory)
    if name == "dcp.async_save":
        return DCPAsyncCheckpointer(state, directory, staging="sync")
    if name == "dcp.async_save+async-staging":
        return DCPAsyncCheckpointer(state, directory, staging="async")
    raise ValueError(f"unknown method {name!r}")


@dataclass
class SaveTiming:
    """One checkpoint outside a training loop: when the call returned, the state was free, it was durable."""

    call_s: float
    staged_s: float  # from the request until the state may change: the worst case a trainer can block
    durable_s: float


def time_save(ckpt: Checkpointer, step: int) -> SaveTiming:
    """Checkpoint once and wait: the request-to-captured and request-to-durable times of ``ckpt``."""
    settle()
    record = ckpt.save(step)
    call_s = time.perf_counter() - record.requested
    ckpt.wait_staged()
    staged_s = time.perf_counter() - record.requested
    ckpt.drain()
    return SaveTiming(call_s, staged_s, time.perf_counter() - record.requested)


def train_run(
    state: GPTState, ckpt: Checkpointer, steps: int, every: int, sync: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Train ``steps`` steps, checkpointing after every ``every``-th (none in the last interval, so the
    last checkpoint's background work still overlaps training); ``sync`` ends each step on a GPU."""
    ckpt.clear()
    settle()
    first = len(ckpt.records)
    step_s = []
    if sync:
        sync()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        t = time.perf_counter()
        state.train_step(before_step=ckpt.before_step)
        if step % every == 0 and step + every <= steps:
            ckpt.save(step)
        if sync:
            sync()
        step_s.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - started
    drain_s = ckpt.drain()
    records = ckpt.records[first:]
    return {"loop_s": loop_s, "drain_s": drain_s, "step_s": step_s,
            "blocked_s": [r.blocked_s for r in records], "durable_s": [r.durable_s for r in records]}


def train_rounds(
    state: GPTState,
    ckpts: Mapping[str, Checkpointer],
    steps: int,
    every: int,
    repeats: int,
    sync: Callable[[], object] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """:func:`train_run` of every method, interleaved over ``repeats`` rounds; one progress line per run."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ckpts}
    for repeat, name in interleave(list(ckpts), repeats):
        result = train_run(state, ckpts[name], steps, every, sync)
        runs[name].append(result)
        print(f"round {repeat + 1} {name:30s} loop {result['loop_s']:.2f} s  blocked "
              + " ".join(f"{b:.3f}" for b in result["blocked_s"]) + " s", file=sys.stderr, flush=True)
    return runs


def warm_up(ckpts: Iterable[Checkpointer]) -> None:
    """One checkpoint per method before timing (allocations, stager caches, first-use imports), then forget it."""
    for ckpt in ckpts:
        ckpt.save(0)
        ckpt.drain()
        ckpt.clear()
        ckpt.records.clear()


def slowdown_note(every: int) -> str:
    """How the blocked table's two slowdowns are computed (shared by blocked.py and gpu.py)."""
    return ("slowdown (run) = loop wall time / the `none` run of the same round - 1, median over rounds (a run has "
            "no checkpoint in its last interval); slowdown (steady) = extra seconds per checkpoint within the run "
            "(its steps' sum - steps x its median step, minus the median of the same over the `none` runs) / "
            f"({every} x that median step): a long run checkpointing every {every} steps; 'durable after' = from "
            "the request to committed on disk; one untimed warm-up checkpoint per method first")


def blocked_report(
    name: str, title: str, runs: Mapping[str, list[dict[str, Any]]], async_baseline: str, every: int
) -> Report:
    """The blocked-time table: per method, blocked seconds per checkpoint and the slowdown vs ``none``.

    Two slowdowns: ``run`` is the loop's wall time over the ``none`` run of the same round (a run has
    no checkpoint in its last interval, so it holds fewer than one per ``every`` steps); ``steady`` is
    what a long run with a checkpoint every ``every`` steps loses: the extra seconds per checkpoint,
    taken within the run (sum of its steps - steps x its median step, so drift of the shared machine
    between runs cancels; minus the median of the same excess over the ``none`` runs, which the skew
    of step times gives even without checkpoints), over ``every`` median steps.
    """
    report = Report(name, title, ["method", "blocked/ckpt", "max", "torch.save÷this", f"{async_baseline}÷this",
                                  "step", "slowdown (run)", f"slowdown (steady, every {every})", "durable after"])

    def blocked_of(method: str) -> list[float]:
        return [b for r in runs.get(method, []) for b in r["blocked_s"]]

    base_save, base_async = median(blocked_of("torch.save")), median(blocked_of(async_baseline))
    baseline = runs.get("none")
    for method, method_runs in runs.items():
        blocked = blocked_of(method)
        b = median(blocked)
        compared = bool(blocked) and method != CopyFloorCheckpointer.name  # the floor saves nothing: no ratio
        slowdowns, steady = [], []
        if baseline and method != "none":
            slowdowns = [r["loop_s"] / n["loop_s"] - 1 for r, n in zip(method_runs, baseline, strict=True)]
        def excess(run: dict[str, Any]) -> float:  # seconds above the run's own median step
            return sum(run["step_s"]) - len(run["step_s"]) * median(run["step_s"])

        # Steps are skewed (an occasional slow one), so a run without checkpoints has some excess too: the
        # median excess of the `none` runs is subtracted (one round's own `none` run, as before, let one
        # stray 2.5 s step there turn that round's checkpoints into a negative cost).
        skew = median(excess(n) for n in baseline) if baseline else 0.0
        for r in method_runs if method != "none" else []:
            if r["blocked_s"]:
                per_checkpoint = (excess(r) - skew) / len(r["blocked_s"])
                steady.append(per_checkpoint / (every * median(r["step_s"])))
        report.add(
            method,
            fmt_s(b) if blocked else "-",
            fmt_s(max(blocked)) if blocked else "-",
            fmt_ratio(base_save / b) if compared else "-",
            fmt_ratio(base_async / b) if compared else "-",
            fmt_s(median(s for r in method_runs for s in r["step_s"])),
            f"{median(slowdowns) * 100:+.1f}%" if slowdowns else "-",
            f"{median(steady) * 100:+.1f}%" if steady else "-",
            fmt_s(median(d for r in method_runs for d in r["durable_s"])) if blocked else "-",
        )
        report.raw[method] = {"runs": method_runs, "slowdowns": slowdowns, "steady_slowdowns": steady}
    return report


# --- reporting ---------------------------------------------------------------------------------------
@dataclass
class Report:
    """A titled table printed with rich and saved (with the machine facts) as JSON for RESULTS.md."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def add(self, *cells: object) -> None:
        self.rows.append([c if isinstance(c, str) else f"{c}" for c in cells])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=self.title, title_justify="left")
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        console = Console(highlight=False, width=max(150, shutil.get_terminal_size().columns))
        console.print(table)
        for text in self.notes:
            console.print(f"  {text}", soft_wrap=True)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(self.columns) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        lines += [""] + [f"- {text}" for text in self.notes]
        return "\n".join(lines) + "\n"


def save_reports(
    script: str, reports: list[Report], facts: Mapping[str, str], argv: list[str] | None, tag: str = ""
) -> Path:
    """``benchmarks/results/<script>[-<tag>].json`` (raw numbers) and ``.md`` (the tables as printed),
    headed by the command that made them (``argv``: the script's arguments, None = this process's)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"{script}-{tag}" if tag else script
    facts = {**facts, "load_avg_end": f"{load_average():.2f}"}
    command = "python " + " ".join([f"benchmarks/{script}.py", *(sys.argv[1:] if argv is None else argv)])
    payload = {"command": command, "machine": facts, "reports": [vars(r) for r in reports]}
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    md = [f"`{command}`", "", *(f"- {k}: {v}" for k, v in facts.items()), ""] + [r.markdown() for r in reports]
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(md))
    print(f"raw numbers: {path}", file=sys.stderr)
    return path


def fmt_s(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "-"
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_ratio(value: float) -> str:
    if value != value or value == float("inf"):
        return "-"
    return f"{value:.0f}x" if value >= 10 else f"{value:.2f}x"


def fmt_bytes(nbytes: float) -> str:
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


@contextlib.contextmanager
def bench_root(name: str, keep: bool = False) -> Iterator[Path]:
    """``./checkpoints/bench-<name>/``, removed afterwards unless ``keep``."""
    root = fresh_dir(BENCH_ROOT / f"bench-{name}")
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
