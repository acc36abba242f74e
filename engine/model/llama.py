"""Our own Llama forward pass over a paged KV cache (no transformers modules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.kernels.cpu.build import kernels_for
from engine.kv.cache import PagedKVCache
from engine.model.attention import AttentionPlan, attend, plan_attention
from engine.model.batch import ForwardBatch
from engine.model.linear import (
    Linear,
    Matrices,
    Projection,
    WeightLayout,
    layout_for,
    measure_quant_rows,
)
from engine.model.rope import RotaryEmbedding, apply_rope
from engine.model.workspace import Workspace
from engine.weights.files import EMBED, LM_HEAD
from engine.weights.quant_blocks import QuantMatrix, dequantize
from engine.weights.spec import ModelSpec


@dataclass(frozen=True)
class Layer:
    """One decoder layer ready to run: its norms, and its matrices as `layout` multiplies them
    (q/k/v and gate/up are each one projection of the same input). Plain matrices are views of
    the mapped file, never copied, so every worker on a host shares one copy in the page cache
    (fusing q/k/v would make a private copy); packed ones (engine.model.linear) are private."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Linear
    post_attention_norm: torch.Tensor
    gate_up: Projection
    down: Linear
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # Qwen2's
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # Qwen3's, over each head

    def matrices(self) -> tuple[Matrices, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def with_quant_rows(self, rows: int) -> Layer:
        """The same layer, multiplying over its quant blocks for inputs of at most `rows`
        rows."""
        return replace(self, qkv=replace(self.qkv, quant_rows=rows),
                       o=replace(self.o, quant_rows=rows),
                       gate_up=replace(self.gate_up, quant_rows=rows),
                       down=replace(self.down, quant_rows=rows))


def load_layer(weights: dict[str, torch.Tensor], quant: dict[str, QuantMatrix], index: int,
               layout: WeightLayout, has_bias: bool = False, has_qk_norm: bool = False) -> Layer:
    """Layer `index` from Hugging Face-named `weights` (and the `quant` blocks of those that
    have them), its matrices prepared by `layout`; with `has_bias`, its q/k/v biases; with
    `has_qk_norm`, its q and k norms."""
    prefix = f"model.layers.{index}."

    def get(name: str) -> torch.Tensor:
        if prefix + name not in weights:
            raise ValueError(f"missing weight {prefix + name}")
        return weights[prefix + name]

    def matrix(name: str) -> torch.Tensor | None:
        """Its dense copy; None where it has quant blocks only."""
        return None if prefix + name in quant and prefix + name not in weights else get(name)

    def project(*names: str) -> Projection:
        return layout.project([matrix(name) for name in names],
                              [quant.get(prefix + name) for name in names])

    def linear(name: str) -> Linear:
        return layout.linear(matrix(name), quant.get(prefix + name))

    return Layer(
        input_norm=get("input_layernorm.weight"),
        qkv=project("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight"),
        o=linear("self_attn.o_proj.weight"),
        post_attention_norm=get("post_attention_layernorm.weight"),
        gate_up=project("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        down=linear("mlp.down_proj.weight"),
        qkv_bias=((get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"),
                   get("self_attn.v_proj.bias")) if has_bias else None),
        qk_norm=((get("self_attn.q_norm.weight"), get("self_attn.k_norm.weight"))
                 if has_qk_norm else None),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of `[N, hidden]` rows, computed in fp32 and rounded once to x's dtype
    (transformers rounds the normalized x before scaling it: at most one bf16 step apart)."""
    module = kernels_for(x, weight)
    if module is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return module.rms_norm(x, weight, eps)  # one pass; torch's takes ~10 small kernels


class LlamaModel:
    """Llama decoder: RMSNorm, RoPE (with scaling), GQA attention, SwiGLU MLP; Qwen2's, the
    same with biases on q, k and v; Qwen3's, with each head's q and k RMS-normalized before
    RoPE; Mistral's, the same as Llama's under a sliding window."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor],
                 layout: WeightLayout | None = None, quant: dict[str, QuantMatrix] | None = None,
                 quant_rows: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`layout`: how weight matrices are stored; by default the fastest for their dtype.
        `quant`: the quant blocks of the weights that have them (engine.weights.quant_blocks),
        used for products of at most `quant_rows` rows (None: as many as are faster here,
        measured). `reduce`: sums the attention and MLP outputs over the ranks of a
        tensor-parallel worker, whose heads and MLP columns `spec` and `weights` are this
        rank's share of (engine.tp)."""
        self.spec = spec
        self.norm = weights["model.norm.weight"]
        self.dtype = self.norm.dtype
        self.layout = layout or layout_for(self.dtype, self.norm.device)
        quant = quant if quant and kernels_for(self.norm) is not None else {}
        self.embed = Embedding.of(weights, quant, self.dtype)
        if self.embed.shape != (spec.vocab_size, spec.hidden_size):
            raise ValueError(f"{EMBED} has shape {self.embed.shape}, spec disagrees")
        tied = (weights[LM_HEAD] is weights.get(EMBED)) if LM_HEAD in weights \
            else LM_HEAD not in quant
        head = EMBED if tied else LM_HEAD
        self.lm_head = self.layout.linear(weights.get(head), quant.get(head))
        self.layers = [load_layer(weights, quant, i, self.layout, spec.qkv_bias, spec.qk_norm)
                       for i in range(spec.num_layers)]
        if quant_rows is None:
            quant_rows = measure_quant_rows(self.matrices(), self.dtype) if quant else 0
        self.quant_rows = quant_rows
        self.lm_head = replace(self.lm_head, quant_rows=quant_rows)
        self.layers = [layer.with_quant_rows(quant_rows) for layer in self.layers]
        self.device = self.norm.device
        self.tensor_parallel = reduce is not None
        self.reduce = reduce or (lambda x: x)
        self.rope = RotaryEmbedding(spec, self.dtype, self.device)
        self.workspace = Workspace(self.device)
        self._none_kept = torch.empty(0, spec.hidden_size, dtype=self.dtype, device=self.device)
        self.hidden = self._none_kept  # the last pass's rows' final hidden states, if it asked

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        cache: PagedKVCache,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """fp32 logits `[R, vocab]`: of each sequence's last new token, or of all its new
        tokens where the batch asks (`ForwardBatch.all_logits`), in order.

        Writes every new token's K/V into `cache`; `layer_hook(i)` runs as soon as layer i's
        K/V are written (every rank's, in a tensor-parallel worker: after its attention). Keeps
        the rows' final hidden states in `hidden` where the batch asks (`ForwardBatch.hidden`).
        """
        assert cache.dtype == self.dtype, f"cache is {cache.dtype}, model is {self.dtype}"
        plan = plan_attention(batch, cache.block_size, cache.dtype,
                              window=self.spec.sliding_window)
        self.check_inputs(plan)
        logits = self.run(plan.to(cache.device), cache, layer_hook)
        if not batch.hidden:
            self.hidden = self._none_kept  # not even a view of the rows: their memory goes
        return logits

    @torch.inference_mode()
    def run(self, plan: AttentionPlan, cache: PagedKVCache,
            layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """`forward` of a planned batch, its tensors on the model's device: the part a CUDA
        graph captures (engine.model.graphs)."""
        step = _Step(plan, *self.rope.lookup(plan.positions), cache, layer_hook)
        x = self.embed(plan.token_ids)
        for index, layer in enumerate(self.layers):
            x = self._layer(index, layer, x, step)
        rows = rms_norm(x[plan.logit_rows], self.norm, self.spec.rms_norm_eps)
        self.hidden = rows  # a reference, no copy (`forward` drops it unless asked)
        return self.lm_head(rows).float()

    def matrices(self) -> list[Matrices]:
        """Every weight matrix (timing a few layers, warm in cache, favours the dense ones)."""
        return [self.lm_head, *(matrices for layer in self.layers for matrices in layer.matrices())]

    def check_inputs(self, plan: AttentionPlan) -> None:
        """Refuse positions past the model's and token ids outside its vocabulary."""
        if int(plan.positions.max()) >= self.spec.max_position_embeddings:
            raise ValueError(f"positions exceed {self.spec.max_position_embeddings}")
        if not 0 <= int(plan.token_ids.min()) <= int(plan.token_ids.max()) < self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")

    def _layer(self, index: int, layer: Layer, x: torch.Tensor, step: _Step) -> torch.Tensor:
        spec = self.spec
        num_tokens = x.shape[0]
        h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
        q_size = spec.num_heads * spec.head_dim
        q, k, v = layer.qkv(h)
        if layer.qkv_bias is not None:
            q, k, v = (t + bias for t, bias in zip((q, k, v), layer.qkv_bias, strict=True))
        q, k = self._heads(layer, q, k)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        v = v.view_as(k)
        step.cache.store(index, step.plan.slots, k, v)
        if step.layer_hook is not None and not self.tensor_parallel:
            step.layer_hook(index)
        cache = step.cache
        attn = attend(q, (k, v), cache.k[index], cache.v[index], step.plan, self.workspace)
        x = x + self.reduce(layer.o(attn.reshape(num_tokens, q_size)))
        if step.layer_hook is not None and self.tensor_parallel:
            step.layer_hook(index)  # every rank has written its heads: it has summed with us
        h = rms_norm(x, layer.post_attention_norm, spec.rms_norm_eps)
        gate, up = layer.gate_up(h)
        return x + self.reduce(layer.down(F.silu(gate) * up))


    def _heads(self, layer: Layer, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as `[N, heads, head_dim]`, each head RMS-normalized where the layer has
        norms for them (Qwen3)."""
        spec, num_tokens = self.spec, q.shape[0]
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            q = rms_norm(q.reshape(-1, spec.head_dim), q_norm, spec.rms_norm_eps)
            k = rms_norm(k.reshape(-1, spec.head_dim), k_norm, spec.rms_norm_eps)
        return (q.view(num_tokens, spec.num_heads, spec.head_dim),
                k.view(num_tokens, spec.num_kv_heads, spec.head_dim))


@dataclass(frozen=True)
class Embedding:
    """The token embedding: a dense matrix, or its quant blocks, whose rows are dequantized
    as tokens look them up."""

    dense: torch.Tensor | None
    quant: QuantMatrix | None
    dtype: torch.dtype

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], quant: dict[str, QuantMatrix],
           dtype: torch.dtype) -> Embedding:
        if EMBED not in weights and EMBED not in quant:
            raise ValueError(f"the model has no {EMBED}")
        return cls(weights.get(EMBED), None if EMBED in weights else quant[EMBED], dtype)

    @property
    def shape(self) -> tuple[int, int]:
        if self.dense is not None:
            return self.dense.shape[0], self.dense.shape[1]
        assert self.quant is not None
        return self.quant.shape

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.embedding(token_ids, self.dense)
        assert self.quant is not None
        rows = QuantMatrix(self.quant.packed[token_ids], self.quant.bits)
        return dequantize(rows).to(self.dtype)


@dataclass(frozen=True)
class _Step:
    """What every layer of one forward pass shares."""

    plan: AttentionPlan
    cos: torch.Tensor  # [N, 1, head_dim]
    sin: torch.Tensor
    cache: PagedKVCache
    layer_hook: Callable[[int], None] | None
