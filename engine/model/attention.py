"""Attention over the paged KV cache, planned once per forward pass and reused by every layer.

New tokens of all sequences are laid out as consecutive rows of one flat batch. Single-token
sequences (decode steps) attend together, straight from the paged cache
(engine.kernels.cpu.paged_decode); longer ones (prefill chunks) each attend causally to cached
prefix + new tokens, straight from the cache where engine.kernels.cpu.paged_prefill applies
(bf16 on a CPU with AVX512-BF16), else in their own SDPA call. Under a sliding window (Mistral)
a query sees only its `window` latest keys (itself included), as transformers masks them: where
the window hides some key of a sequence, its attention is masked SDPA over the gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from engine.kernels.cpu.paged_decode import paged_decode
from engine.kernels.cpu.paged_prefill import kernel_is_faster, paged_prefill
from engine.kv.allocator import blocks_needed
from engine.kv.cache import slot_mapping
from engine.model.batch import ForwardBatch
from engine.model.workspace import Workspace

_Plan = TypeVar("_Plan", "DecodePlan", "PrefillPlan")


def _moved(plan: _Plan, device: torch.device) -> _Plan:
    """`plan` with each of its tensors on `device` (copied without waiting, as a step's inputs
    are)."""
    moves: dict[str, Any] = {f.name: value.to(device, non_blocking=True) for f in fields(plan)
                             if isinstance(value := getattr(plan, f.name), torch.Tensor)}
    return replace(plan, **moves)


@dataclass(frozen=True)
class DecodePlan:
    """The single-token sequences of a batch, attended to together."""

    rows: torch.Tensor  # [B] their rows in the flat batch
    blocks: torch.Tensor  # [B, max_blocks] their block tables, padded, covering every context
    contexts: torch.Tensor  # [B] tokens each attends to (cached + itself)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size]: 0 for keys in context, else -inf
    windowed: bool = False  # the window hides some key in context: only the mask applies it


@dataclass(frozen=True)
class PrefillPlan:
    """One multi-token sequence: rows begin..end-1 attend causally to its whole context."""

    begin: int
    end: int
    blocks: torch.Tensor  # [num_blocks] the blocks holding its context
    context_len: int  # cached prefix + new tokens
    mask: torch.Tensor | None  # [T, context_len]; None means plain causal (no cached prefix)
    windowed: bool = False  # the window hides some key in context: only the mask applies it


@dataclass(frozen=True)
class AttentionPlan:
    """Where each new token goes and what it attends to."""

    block_size: int
    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] absolute position of each new token
    slots: torch.Tensor  # [N] cache slot each new token's K/V is written to
    # [R] the rows whose logits the forward pass returns: each sequence's last new token's,
    # or every new token's of a sequence that asks (ForwardBatch.all_logits)
    logit_rows: torch.Tensor
    decode: DecodePlan | None
    prefills: tuple[PrefillPlan, ...]

    def to(self, device: torch.device) -> AttentionPlan:
        """The same plan with its tensors on `device` (itself where they are already)."""
        if device.type == "cpu":
            return self
        tensors = {name: getattr(self, name).to(device, non_blocking=True)
                   for name in ("token_ids", "positions", "slots", "logit_rows")}
        decode = _moved(self.decode, device) if self.decode is not None else None
        return replace(self, **tensors, decode=decode,
                       prefills=tuple(_moved(prefill, device) for prefill in self.prefills))


def plan_attention(
    batch: ForwardBatch, block_size: int, dtype: torch.dtype = torch.float32,
    decode_blocks: int | None = None, window: int | None = None,
) -> AttentionPlan:
    """Vectorized index bookkeeping for `batch` over a cache of `block_size`-token blocks;
    decode steps attend over `decode_blocks` blocks of their tables (masked past each
    context), by default as many as the longest context fills. `window`: each query sees
    only that many latest keys (None: all before it)."""
    tables = _padded_tables(batch, block_size)
    lengths = [len(tokens) for tokens in batch.token_ids]
    begins = list(accumulate(lengths, initial=0))
    prefills = tuple(
        _plan_prefill(tables[i], begins[i], batch.start_positions[i], lengths[i], block_size,
                      window)
        for i in range(batch.num_seqs)
        if lengths[i] > 1
    )
    counts, starts = torch.tensor(lengths), torch.tensor(batch.start_positions)
    ends = torch.tensor(begins[1:])
    seq_of_row = torch.repeat_interleave(torch.arange(batch.num_seqs), counts)
    positions = starts[seq_of_row] + torch.arange(begins[-1]) - (ends - counts)[seq_of_row]
    is_decode = torch.nonzero(counts == 1).flatten()
    return AttentionPlan(
        block_size=block_size,
        token_ids=torch.tensor([t for tokens in batch.token_ids for t in tokens]),
        positions=positions,
        slots=slot_mapping(tables[seq_of_row], positions[:, None], block_size)[:, 0],
        logit_rows=_logit_rows(batch, ends),
        decode=_plan_decode(tables[is_decode], starts[is_decode], ends[is_decode], block_size,
                            dtype, decode_blocks, window),
        prefills=prefills,
    )


def _logit_rows(batch: ForwardBatch, ends: torch.Tensor) -> torch.Tensor:
    if not any(batch.all_logits):
        return ends - 1
    lengths = [len(tokens) for tokens in batch.token_ids]
    return torch.cat([torch.arange(end - length if every else end - 1, end)
                      for end, length, every in zip(ends.tolist(), lengths, batch.all_logits,
                                                    strict=True)])


def _padded_tables(batch: ForwardBatch, block_size: int) -> torch.Tensor:
    """Block tables as one `[num_seqs, max_blocks]` tensor, after checking each is big enough."""
    for start, tokens, table in zip(
        batch.start_positions, batch.token_ids, batch.block_tables, strict=True
    ):
        if start + len(tokens) > len(table) * block_size:
            raise ValueError(
                f"{start + len(tokens)} tokens do not fit {len(table)} blocks of {block_size}"
            )
    width = max(len(table) for table in batch.block_tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in batch.block_tables])


def _plan_decode(
    tables: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, block_size: int,
    dtype: torch.dtype, num_blocks: int | None, window: int | None,
) -> DecodePlan | None:
    if len(tables) == 0:
        return None
    context = starts + 1
    num_blocks = num_blocks or blocks_needed(int(context.max()), block_size)
    assert num_blocks <= tables.shape[1]
    keys = torch.arange(num_blocks * block_size)
    visible = keys[None, :] < context[:, None]
    hiding = _hiding(window, int(context.max()))
    if hiding is not None:
        visible &= keys[None, :] >= (context - hiding)[:, None]
    # Additive and built once per step: SDPA would convert a boolean mask in every layer.
    mask = torch.zeros(visible[:, None, None, :].shape, dtype=dtype)
    mask.masked_fill_(~visible[:, None, None, :], float("-inf"))
    return DecodePlan(ends - 1, tables[:, :num_blocks].contiguous(), context, mask,
                      hiding is not None)


def _plan_prefill(
    table: torch.Tensor, begin: int, start: int, num_new: int, block_size: int,
    window: int | None,
) -> PrefillPlan:
    context_len = start + num_new
    blocks = table[: blocks_needed(context_len, block_size)]
    hiding = _hiding(window, context_len)
    mask = None
    if start > 0 or hiding is not None:
        queries = torch.arange(start, context_len)[:, None]
        keys = torch.arange(context_len)[None, :]
        mask = queries >= keys
        if hiding is not None:
            mask &= keys > queries - hiding
    return PrefillPlan(begin, begin + num_new, blocks, context_len, mask, hiding is not None)


def _hiding(window: int | None, longest_context: int) -> int | None:
    """`window`, where it hides some key of a context this long; else None."""
    return window if window is not None and longest_context > window else None


def attend(
    q: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, workspace: Workspace,
) -> torch.Tensor:
    """Attention output `[N, H, D]` of queries `q` `[N, H, D]` over one layer's cache.

    `new_kv` holds the batch's own new K and V `[N, Hkv, D]` (already in the cache too): a
    prompt with nothing cached before it attends to those directly, without a gather.

    Padded keys are masked out but still multiplied by 0, so the cache must hold finite
    values everywhere (it starts zeroed).
    """
    decode, paged = plan.decode, _Paged(k_cache, v_cache, plan.block_size, workspace)
    if decode is not None and not plan.prefills:
        return _decode_attention(q, paged, decode)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.rows] = _decode_attention(q[decode.rows], paged, decode)
    for prefill in plan.prefills:
        rows = slice(prefill.begin, prefill.end)
        start = prefill.context_len - (prefill.end - prefill.begin)
        direct = paged_prefill(q[rows], k_cache, v_cache, prefill.blocks, start, plan.block_size
                               ) if kernel_is_faster(q.dtype) and not prefill.windowed else None
        if direct is not None:
            out[rows] = direct
        elif prefill.mask is None:  # nothing cached before this prompt
            out[rows] = _causal_attention(q[rows], new_kv[0][rows], new_kv[1][rows])
        else:
            out[rows] = _prefill_attention(q[rows], paged, prefill)
    return out


@dataclass(frozen=True)
class _Paged:
    """One layer's paged K and V, and where to gather them."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    workspace: Workspace

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` (`[..., num_blocks]`) in order: `[..., num_blocks * bs, H, D]`.

        Whole blocks copied with index_select: far faster on CPU than gathering single slots,
        and about 8x faster than advanced indexing with a 2-D index.
        """
        return self._gather("k", self.k, blocks), self._gather("v", self.v, blocks)

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        paged = cache.view(-1, self.block_size, *cache.shape[1:])
        shape = (blocks.numel(), *paged.shape[1:])
        out = self.workspace.take(f"gather_{name}", shape, cache.dtype)
        torch.index_select(paged, 0, blocks.reshape(-1), out=out)
        return out.view(*blocks.shape, *paged.shape[1:]).flatten(-4, -3)


def _decode_attention(q: torch.Tensor, paged: _Paged, plan: DecodePlan) -> torch.Tensor:
    if not plan.windowed:
        direct = paged_decode(q, paged.k, paged.v, plan.blocks, plan.contexts, paged.block_size)
        if direct is not None:
            return direct
    return gathered_decode(q, paged.k, paged.v, plan, paged.block_size, paged.workspace)


def gathered_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: DecodePlan, block_size: int, workspace: Workspace) -> torch.Tensor:
    """Decode attention `[B, H, D]` by gathering every context into one padded tensor for a
    masked SDPA: where the C++ kernel does not apply, and `bench attention`'s baseline."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    paged = _Paged(k_cache, v_cache, block_size, workspace)
    k, v = (t.transpose(1, 2) for t in paged.gather(plan.blocks))  # [B, Hkv, len, D]
    # A query head group sharing one kv head plays the role of the query length, so K/V are
    # never repeated per query head.
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)
    return out.reshape(batch, num_heads, head_dim)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of `[T, H, D]` queries over `[T, Hkv, D]` keys and values."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def gathered_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: PrefillPlan, block_size: int, workspace: Workspace) -> torch.Tensor:
    """A prompt chunk's causal attention `[T, H, D]` by gathering its context for SDPA: where
    the C++ kernel does not apply, and `bench prefill-attention`'s baseline."""
    return _prefill_attention(q, _Paged(k_cache, v_cache, block_size, workspace), plan)


def _prefill_attention(q: torch.Tensor, paged: _Paged, plan: PrefillPlan) -> torch.Tensor:
    context = slice(0, plan.context_len)
    k, v = (t[context].transpose(0, 1)[None] for t in paged.gather(plan.blocks))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v,
        attn_mask=plan.mask, is_causal=plan.mask is None, enable_gqa=True,
    )
    return out[0].transpose(0, 1)

