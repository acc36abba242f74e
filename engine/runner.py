"""A loaded model with its paged KV cache and block allocator, ready to run batches; and how a
worker builds one from config (`load_runner`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from core.config import (
    EngineConfig,
    ModelConfig,
    PoolConfig,
    QuantInputs,
    SimConfig,
    WeightsMode,
)
from core.cpus import pinned_cpus
from engine.heap import return_freed_memory
from engine.kernels.cpu.build import build_problem, kernels, running_isa, use_isa
from engine.kernels.isa import ISA_FLAGS, cpu_flags, cpu_name
from engine.kv.allocator import BlockAllocator
from engine.kv.cache import PagedKVCache
from engine.locate import resolve_model
from engine.model.batch import ForwardBatch
from engine.model.chunk_cost import ChunkCost
from engine.model.graphs import DecodeGraphs
from engine.model.llama import LlamaModel
from engine.sim.runner import SimRunner
from engine.tp.runner import TensorParallelRunner
from engine.weights.choice import choose_weights
from engine.weights.dtypes import resolve_dtype
from engine.weights.load import load_weights
from engine.weights.quant_blocks import load_quant_blocks
from engine.weights.quant_rows import MeasuredQuantRows
from engine.weights.spec import ModelSpec, kv_fingerprint, load_spec

log = logging.getLogger(__name__)


def torch_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype `model.dtype` names ("auto" resolved for `device`, by default this
    CPU)."""
    dtype: torch.dtype = getattr(torch, resolve_dtype(name, device.type if device else "cpu"))
    return dtype


def torch_device(name: str) -> torch.device:
    """The device `model.device` names; "auto" is the current GPU where torch sees one."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device is {name}, but this torch ({torch.__version__}) "
                             "sees no GPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"model.device is {name}, but {torch.cuda.device_count()} GPUs "
                             "are visible")
        device = torch.device("cuda", index)
    return device


def on_device(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`weights` copied to `device`, a tensor named twice (tied embeddings) copied once."""
    if device.type == "cpu":
        return weights
    copies: dict[int, torch.Tensor] = {}
    return {name: copies.setdefault(id(tensor), tensor.to(device))
            for name, tensor in weights.items()}


def set_threads(n: int | None) -> None:
    """Use `n` intra-op CPU threads; None keeps torch's default."""
    if n is None:
        return
    if n <= 0:
        raise ValueError(f"thread count must be positive, got {n}")
    torch.set_num_threads(n)


class Runner(Protocol):
    """What a worker runs batches with: `ModelRunner`, or `SimRunner` for a simulated model."""

    model_dir: Path
    spec: ModelSpec
    block_size: int
    device: torch.device
    cache: PagedKVCache
    allocator: BlockAllocator
    chunk_cost: ChunkCost

    @property
    def kernel_isa(self) -> str: ...

    @property
    def kv_fingerprint(self) -> str: ...

    def forward(self, batch: ForwardBatch,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor: ...

    @property
    def hidden(self) -> torch.Tensor:
        """The final hidden states of the last pass's logit rows, when its batch asked
        (`ForwardBatch.hidden`)."""


class ModelRunner:
    """Owns the model, a `num_blocks` x `block_size` KV cache and the allocator of its blocks."""

    def __init__(
        self,
        model_dir: Path,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        quant_rows: int | None = None,
        quant_inputs: QuantInputs = "exact",
        device: torch.device | str = "cpu",
        cuda_graphs: bool = True,
        weights: WeightsMode = "auto",
    ) -> None:
        """`quant_rows`: products of at most this many rows read the model's quant blocks
        where it has them (engine.weights.quant_blocks); None: measured here at load, 0:
        never. `quant_inputs`: what those products multiply (`model.quant_inputs`).
        `device`: where weights, cache and step inputs live; on a GPU, decode steps replay
        CUDA graphs unless `cuda_graphs` is off. `weights`: which copies of the matrices to
        multiply (engine.weights.choice)."""
        self.model_dir = Path(model_dir)
        self.spec = load_spec(self.model_dir)
        self.block_size = block_size
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        dense, quant = choose_weights(load_weights(self.model_dir, dtype),
                                      load_quant_blocks(self.model_dir, quant_inputs == "int8"),
                                      weights, dtype, on_cpu and kernels() is not None)
        self.model = LlamaModel(self.spec, on_device(dense, self.device),
                                quant=quant, quant_rows=quant_rows if on_cpu else 0)
        graphed = cuda_graphs and self.device.type == "cuda"
        self.cache = PagedKVCache(self.spec, num_blocks, block_size, dtype, self.device,
                                  pad_block=graphed)
        self.allocator = BlockAllocator(num_blocks)
        self.chunk_cost = ChunkCost.of(self.spec)
        self.graphs = DecodeGraphs(self.model, self.cache) if graphed else None

    @property
    def kernel_isa(self) -> str:
        """The instruction-set level its C++ kernels run at ("torch": none built here; "cuda":
        the model is on a GPU)."""
        if self.device.type == "cuda":
            return "cuda"
        return running_isa()

    @property
    def kv_fingerprint(self) -> str:
        """The KV layout a worker exchanging KV with this one must share."""
        return kv_fingerprint(self.spec, str(self.cache.dtype).removeprefix("torch."))

    def forward(
        self, batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """fp32 logits of each sequence's last new token, or of all its new tokens where the
        batch asks (see LlamaModel), on the runner's device."""
        if self.graphs is not None and layer_hook is None and not batch.hidden:
            logits = self.graphs.replay(batch)
            if logits is not None:
                return logits
        return self.model.forward(batch, self.cache, layer_hook)

    @property
    def hidden(self) -> torch.Tensor:
        return self.model.hidden


def load_runner(model: ModelConfig, pool: PoolConfig, engine: EngineConfig | None = None,
                sim: SimConfig | None = None) -> Runner:
    """The runner a worker of `pool` serves `model` with: its dtype resolved on this CPU, its
    threads set (`pool.threads`, or one per CPU this process may run on), the kernels built at
    the level `engine.isa` picks, the quant row count as measured on this machine (measured
    now, and kept, the first time). A simulated model's runs as `sim` says."""
    if model.sim_profile is not None:
        sim = sim or SimConfig()
        return SimRunner(resolve_model(model.name, model.cache_dir), pool.num_kv_blocks,
                         pool.block_size, sim.kv_bytes, sim.time_scale)
    device = torch_device(model.device)
    dtype = resolve_dtype(model.dtype, device.type)
    set_threads(pool.threads or len(pinned_cpus()))
    tp = pool.tp or model.tp
    if device.type == "cuda":
        if tp > 1:
            raise ValueError("model.tp > 1 runs on CPUs (gloo) only")
        return _load_cuda_runner(model, pool, engine or EngineConfig(), device, dtype)
    folder = resolve_model(model.name, model.cache_dir)
    level = use_isa((engine or EngineConfig()).isa)
    # Found, or built if stale, before the worker registers: built inside its first decode
    # step, it would hold back heartbeats for ~30 s and the gateway would declare it dead.
    built = kernels() is not None
    log.info("kernels: %s (%s) on %s; CPU flags %s", level.name,
             "built" if built else f"torch ops instead: {build_problem()}", cpu_name() or "?",
             " ".join(sorted(cpu_flags() & ISA_FLAGS)))
    measured = MeasuredQuantRows(folder, model.quant_inputs)
    rows = model.quant_rows if model.quant_rows >= 0 else measured.get(dtype)
    if tp > 1:  # measured by one process (python -m engine), if at all
        split = TensorParallelRunner(folder, pool.num_kv_blocks, pool.block_size,
                                     torch_dtype(dtype), tp, None, model.weights,
                                     model.quant_inputs, rows or 0)
        return_freed_memory()
        return split
    runner = ModelRunner(folder, pool.num_kv_blocks, pool.block_size, torch_dtype(dtype), rows,
                         model.quant_inputs, weights=model.weights)
    matrices = runner.model.matrices()
    if rows is None and any(m.quant and m.matrices for m in matrices):  # measured just now
        measured.put(dtype, runner.model.quant_rows)
    return_freed_memory()  # the weights as loaded are gone now
    log.info("products of up to %d rows read the weights' quant blocks (inputs: %s); "
             "%d of %d matrices are read from them only", runner.model.quant_rows,
             model.quant_inputs, sum(not m.matrices for m in matrices), len(matrices))
    return runner


def _load_cuda_runner(model: ModelConfig, pool: PoolConfig, engine: EngineConfig,
                      device: torch.device, dtype: str) -> ModelRunner:
    torch.cuda.set_device(device)  # CUDA IPC handles open on the current device
    if pool.gpu_memory_fraction > 0:
        torch.cuda.set_per_process_memory_fraction(pool.gpu_memory_fraction, device)
    folder = resolve_model(model.name, model.cache_dir)
    runner = ModelRunner(folder, pool.num_kv_blocks, pool.block_size, torch_dtype(dtype, device),
                         0, model.quant_inputs, device, engine.cuda_graphs, model.weights)
    log.info("model on %s (%s), %s; CUDA graphs %s", device, torch.cuda.get_device_name(device),
             dtype, "on" if runner.graphs is not None else "off")
    return runner
