"""The target model: one pure forward function over stacked, scanned layers.

`forward` does prefill, one-token decode, many-token (tree) verification and feature extraction: the caller
chooses the tokens, their RoPE positions, the mask among the new tokens, and which layers' hidden states come
back. It can also run a layer range [start, end) from given hidden states (early exit, pipeline stages).

Einsum letters: b batch, t new tokens (queries), u new tokens (keys), s cache slots, d model width,
k key/value heads, g query heads per kv head, h head dim, f feed-forward width, v vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, empty_linear_state, write_layer_entries, write_new_entries
from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.gated_delta import (
    PendingDelta,
    chain_conv,
    chain_gated_delta,
    l2_normalize,
    tree_conv,
    tree_gated_delta,
)
from jaxspec.kernels import (
    MAX_COLUMNS,
    cache_attention,
    cache_attention_enabled,
    feature_major_product,
    greedy_head,
    kernels_on,
)
from jaxspec.sampling import SamplingConfig, draws_by_argmax

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """Per-layer weights, every field stacked with a leading layer axis L."""

    attn_norm: jax.Array  # [L, d]
    wq: jax.Array  # [L, d, Hq, h]
    wk: jax.Array  # [L, d, Hkv, h]
    wv: jax.Array  # [L, d, Hkv, h]
    wo: jax.Array  # [L, Hq, h, d]
    mlp_norm: jax.Array  # [L, d]
    w_gate: jax.Array | None = None  # [L, d, f] (None in a mixture-of-experts model)
    w_up: jax.Array | None = None  # [L, d, f]
    w_down: jax.Array | None = None  # [L, f, d]
    bq: jax.Array | None = None  # [L, Hq, h] (Qwen2)
    bk: jax.Array | None = None  # [L, Hkv, h]
    bv: jax.Array | None = None  # [L, Hkv, h]
    q_norm: jax.Array | None = None  # [L, h] (Qwen3, Gemma 3)
    k_norm: jax.Array | None = None  # [L, h]
    post_attn_norm: jax.Array | None = None  # [L, d]: on the attention output before the residual add (Gemma 3)
    post_mlp_norm: jax.Array | None = None  # [L, d]: on the MLP output before the residual add (Gemma 3)
    router: jax.Array | None = None  # [L, d, E]: expert scores (Qwen3-MoE; the MLP is then the experts below)
    expert_gate: jax.Array | None = None  # [L, E, d, F]
    expert_up: jax.Array | None = None  # [L, E, d, F]
    expert_down: jax.Array | None = None  # [L, E, F, d]
    wq_gate: jax.Array | None = None  # [L, d, Hq, h]: the attention output's sigmoid gate (Qwen3.5)
    # Qwen3.5-MoE's shared expert beside the routed ones: a SwiGLU MLP of width Fs, scaled by a sigmoid gate
    shared_gate: jax.Array | None = None  # [L, d, Fs]
    shared_up: jax.Array | None = None  # [L, d, Fs]
    shared_down: jax.Array | None = None  # [L, Fs, d]
    shared_expert_gate: jax.Array | None = None  # [L, d]: sigmoid(x . this) scales the shared expert's output
    # A linear-attention layer (Qwen3.5's Gated DeltaNet, jaxspec.gated_delta) in place of attention; C conv channels
    # (q, k, v), H value heads, K conv taps
    lin_qkv: jax.Array | None = None  # [L, d, C]
    lin_z: jax.Array | None = None  # [L, d, H, Dv]: the output gate
    lin_b: jax.Array | None = None  # [L, d, H]: beta = sigmoid(x lin_b)
    lin_a: jax.Array | None = None  # [L, d, H]: the decay's input
    lin_conv: jax.Array | None = None  # [L, C, K]
    lin_dt_bias: jax.Array | None = None  # [L, H]
    lin_a_log: jax.Array | None = None  # [L, H]
    lin_norm: jax.Array | None = None  # [L, Dv]
    lin_out: jax.Array | None = None  # [L, H, Dv, d]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """All weights of a decoder. `lm_head` is None when the output is tied to the embedding.

    `layers` is one LayerWeights stacked over the layer axis (what loading, sharding and training use; the forward
    scans it), or, on CPU, a tuple of per-layer LayerWeights (`unstack_layers`): see there."""

    embed: jax.Array  # [V, d]
    layers: LayerWeights | tuple[LayerWeights, ...]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | None = None  # [d, V]
    head_screen: HeadScreen | None = None  # the CPU layout's bfloat16 copy of the output matrix (`greedy_tokens`)


SCREEN_CANDIDATES = 8  # tokens the greedy head scores in float32 per position (kCandidates in greedy_head.cc)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadScreen:
    """A bfloat16 copy of the output matrix, from which `greedy_tokens` finds the argmax of the logits reading half
    the bytes of the float32 matrix (113 of SmolLM2's 538 MB a decoding step reads), then checks it in float32.

    error: float32 scalar, with which |screened logit - float32 logit| <= error * ||h||_2 for every token and any
    final-normed hidden state h: max_v ||matrix_v - E_v||_2 (the rounding to bfloat16, by Cauchy-Schwarz) plus
    2 * gamma_d * max_v max(||E_v||_2, ||matrix_v||_2) (both products' float32 rounding, in any order of summation:
    gamma_d = d u / (1 - d u), u = 2^-24)."""

    matrix: jax.Array  # bfloat16 [V, d]
    error: jax.Array  # float32 []
    # float32 [V, d]: an untied output matrix (lm_head [d, V]) as rows, transposed once here: the kernel reads rows,
    # and lm_head.T inside the jitted step copied the whole matrix every step (Qwen2.5-Coder-1.5B: 0.93 GB, 330 of a
    # 640 ms step). None where the output matrix is the embedding (already rows). A draft model rounded to bfloat16
    # (`bfloat16_feature_major_layers`) keeps `matrix` itself here: its logits come from the rounded rows.
    rows: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    """What `forward` returns. logits: [B, T, V] float32 (None when the range stops before the last layer);
    hidden: [n, B, T, d], the residual stream after each layer the caller named (None if none); last_hidden:
    [B, T, d], the residual stream after the range's last layer, before the final norm; cache: with the new
    entries written (lengths unchanged), None when no cache was given; pending: for a hybrid model, what its
    linear-attention layers need to commit (`jaxspec.cache.commit_recurrent`), stacked over those layers."""

    logits: jax.Array | None
    hidden: jax.Array | None
    last_hidden: jax.Array
    cache: KVCache | None
    pending: PendingDelta | None = None


# ---------------------------------------------------------------------------------------------- pieces


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., d], weight: [d]. Computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig, sliding: bool = False) -> np.ndarray:
    """float32[h/2]: RoPE inverse frequencies with the config's scaling (a static constant); with `sliding`, those
    of the sliding-window layers (their own base, unscaled)."""
    h = int(cfg.head_dim * cfg.partial_rotary_factor)  # the rotated dims (a quarter of each head in Qwen3.5)
    theta = cfg.sliding_rope_theta if sliding else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = RopeScaling() if sliding else cfg.rope_scaling
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [B, T, H, h]; positions: int32[B, T]. Rotates halves (the Hugging Face layout) of the first
    2 * len(inv_freq) dims of each head (all of them but with partial rotary embeddings) and keeps the rest."""
    rotated = 2 * inv_freq.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotated], positions, inv_freq), x[..., rotated:]], axis=-1)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, h/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_mask(batch_size: int, num_tokens: int) -> jax.Array:
    """bool[B, T, T]: each new token sees itself and the new tokens before it."""
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), jnp.bool_))
    return jnp.broadcast_to(mask, (batch_size, num_tokens, num_tokens))


def _attention(q, new_k, new_v, cache_k, cache_v, cache_lengths, mask, scale=None, positions=None, window=None,
               cpu_kernel=False):
    """Attention of T new queries over the committed cache slots plus the new tokens under `mask`.

    q: [B, T, Hq, h]; new_k, new_v: [B, T, Hkv, h]; cache_k, cache_v: [B, Hkv, S, h] or None;
    cache_lengths: int32[B]; mask: bool[B, T, T] (query t may see new token u); scale: what the scores are
    multiplied by (default h ** -0.5). window: None, or int32 scalar, this layer's sliding window (0: none, a global
    layer); a query at position p then sees only the keys at positions (p - window, p]: a cache slot's position is
    its index (slots hold a row's tokens from position 0 on), a new token's is in `positions` int32[B, T].
    cpu_kernel: with a float32 cache and no window, run jaxspec's CPU kernel (`jaxspec.kernels.cache_attention`:
    each row's slots up to its length only) where it is enabled; inference only (it has no gradient).
    Returns [B, T, Hq, h].
    """
    b, t, hq, h = q.shape
    hkv = new_k.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    q = q.reshape(b, t, hkv, hq // hkv, h) * scale  # [b, t, k, g, h]
    if (cpu_kernel and cache_k is not None and window is None and cache_attention_enabled()
            and all(a.dtype == jnp.float32 for a in (q, new_k, new_v, cache_k, cache_v))):
        sees = jnp.ones((b, t, t), jnp.bool_) if mask is None else jnp.broadcast_to(mask, (b, t, t))  # [b, t, u]
        out = cache_attention(q, cache_k, cache_v, cache_lengths, new_k, new_v, sees)  # [b, t, k, g, h]
        return out.reshape(b, t, hq, h)
    lowest = None  # int32[B, T]: a sliding layer's query sees the keys at positions above this
    if window is not None:
        lowest = positions - jnp.where(window > 0, window, jnp.iinfo(jnp.int32).max)  # no overflow: positions >= 0
        in_window = positions[:, None, :] > lowest[:, :, None]  # [b, t, u]
        mask = in_window if mask is None else mask & in_window
    scores_new = jnp.einsum("btkgh,bukh->bkgtu", q, new_k, preferred_element_type=jnp.float32)
    if mask is not None:  # None: every new token sees every other (one-token decode)
        scores_new = jnp.where(mask[:, None, None, :, :], scores_new, NEG_INF)
    if cache_k is None:
        probs = jax.nn.softmax(scores_new, axis=-1)
        out = jnp.einsum("bkgtu,bukh->btkgh", probs.astype(new_v.dtype), new_v)
        return out.reshape(b, t, hq, h)
    s = cache_k.shape[2]
    # Both cache products keep the (b, k) batch axes leading and the cache's slot axis in place: XLA's CPU backend
    # runs them as batched library products without transposing the cache. Measured (docs/cpu-performance.md,
    # 30 layers, 384 slots): 2.3x faster than the cache-left orientation used before at B=16 and at B=1 with T=4.
    scores_cache = jnp.einsum("btkgh,bksh->bkgts", q, cache_k.astype(q.dtype),
                              preferred_element_type=jnp.float32)  # [b, k, g, t, s]
    visible = jnp.arange(s)[None, :] < cache_lengths[:, None]  # [b, s]
    if lowest is None:
        scores_cache = jnp.where(visible[:, None, None, None, :], scores_cache, NEG_INF)
    else:
        visible = visible[:, None, :] & (jnp.arange(s)[None, None, :] > lowest[:, :, None])  # [b, t, s]
        scores_cache = jnp.where(visible[:, None, None, :, :], scores_cache, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([scores_cache, scores_new], axis=-1), axis=-1)
    probs_cache, probs_new = probs[..., :s], probs[..., s:]
    out = jnp.einsum("bkgts,bksh->bkgth", probs_cache.astype(q.dtype), cache_v.astype(q.dtype))
    out = out.transpose(0, 3, 1, 2, 4)  # [b, t, k, g, h]
    out = out + jnp.einsum("bkgtu,bukh->btkgh", probs_new.astype(new_v.dtype), new_v)
    return out.reshape(b, t, hq, h)


def _rowwise(spec: str, x: jax.Array, w: jax.Array, rowwise: bool, **einsum_kwargs) -> jax.Array:
    """einsum(spec, x, w) for x: [B, T, ...]; with `rowwise`, one matrix-vector product per (b, t) row.

    XLA's CPU backend runs a 1-row product as a matrix-vector kernel that streams the weight once, but 2-8 rows as a
    matrix product that costs about as much as 2-4 such streams; for a few rows (a verification of a short chain)
    separate 1-row products over an unstacked layer's weight are faster (measured in docs/cpu-performance.md).
    """
    if not rowwise:
        return jnp.einsum(spec, x, w, **einsum_kwargs)
    b, t = x.shape[:2]
    rows = [[jnp.einsum(spec, x[i:i + 1, j:j + 1], w, **einsum_kwargs) for j in range(t)] for i in range(b)]
    return jnp.concatenate([jnp.concatenate(row, axis=1) for row in rows], axis=0)


def _sum_shards(x: jax.Array, model_axis: str | None) -> jax.Array:
    """Tensor parallelism: adds the partial results of the devices that each hold a slice of the heads or of f."""
    return x if model_axis is None else jax.lax.psum(x, model_axis)


def _activation(cfg: ModelConfig, gate: jax.Array) -> jax.Array:
    """The MLP's gate activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
    return jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(gate)


def mixture_of_experts(cfg: ModelConfig, x: jax.Array, lw: LayerWeights, model_axis: str | None = None,
                       grouped: bool | None = None) -> jax.Array:
    """The expert MLP of one layer (Qwen3-MoE): each token goes to the k experts its router scores highest, weighted
    by their softmax probabilities (renormalised over the k when cfg.norm_topk_prob).

    x: [B, T, d] (after the MLP norm); lw: one layer's weights with router [d, E] and its experts [E_local, ...]:
    inside shard_map the experts are split over `model_axis` (expert parallelism) and each device adds the
    contributions of its own experts (the caller sums over the axis). Returns [B, T, d].

    Only the chosen experts run. Few token-expert pairs (M = B*T*k at most E: decoding, a verification round) read
    each pair's expert weights directly, so a step streams M experts rather than all E; more pairs (a prefill) are
    sorted by expert and run as one grouped product per projection (`jax.lax.ragged_dot`). `grouped` forces one
    path (tests).
    """
    b, t, d = x.shape
    k = cfg.num_experts_per_tok
    tokens = x.reshape(b * t, d)  # [N, d]
    scores = jnp.einsum("nd,de->ne", tokens, lw.router.astype(tokens.dtype))
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)  # [N, E]
    weights, experts = jax.lax.top_k(probs, k)  # [N, k] each
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    local_count = lw.expert_gate.shape[0]  # E_local: this device's experts (all of them without a mesh)
    first = 0 if model_axis is None else jax.lax.axis_index(model_axis) * local_count
    local = (experts - first).reshape(-1)  # [M]: each pair's expert among this device's
    mine = (local >= 0) & (local < local_count)  # [M]
    pair_weights = jnp.where(mine, weights.reshape(-1), 0.0).astype(x.dtype)  # [M]
    pairs = jnp.repeat(tokens, k, axis=0)  # [M, d], token-major like `local`
    m = pairs.shape[0]
    if grouped is None:
        grouped = m > cfg.num_experts
    if not grouped:
        chosen = jnp.clip(local, 0, local_count - 1)  # [M]
        gate = jnp.einsum("md,mdf->mf", pairs, lw.expert_gate[chosen])
        up = jnp.einsum("md,mdf->mf", pairs, lw.expert_up[chosen])
        out = jnp.einsum("mf,mfd->md", _activation(cfg, gate) * up, lw.expert_down[chosen])  # [M, d]
    else:
        # sort the pairs by expert, other devices' pairs last (left out of every group: their rows come back 0)
        key = jnp.where(mine, local, local_count)  # [M]
        order = jnp.argsort(key, stable=True)  # [M]
        sizes = jnp.bincount(key, length=local_count + 1)[:local_count].astype(jnp.int32)  # [E_local]
        rows = pairs[order]  # [M, d]
        gate = jax.lax.ragged_dot(rows, lw.expert_gate, sizes)  # [M, F]
        up = jax.lax.ragged_dot(rows, lw.expert_up, sizes)
        done = jax.lax.ragged_dot(_activation(cfg, gate) * up, lw.expert_down, sizes)  # [M, d]
        out = jnp.zeros_like(done).at[order].set(done)  # back in token-major order
    out = out * pair_weights[:, None]  # [M, d]
    return out.reshape(b * t, k, d).sum(axis=1).reshape(b, t, d)


def _layer(cfg: ModelConfig, inv_freq, x, lw: LayerWeights, cache_k, cache_v, cache_lengths, positions, mask,
           model_axis=None, rowwise: bool = False, window=None, in_place: bool = False):
    """One decoder layer. x: [B, T, d]; lw: one layer's weights (no L axis); cache_k/v: [B, Hkv, S, h] or None.

    Head counts come from the weights' shapes, so inside shard_map with the heads and f split over `model_axis`
    this runs on the local slice and sums the two output projections over the axis (Megatron-style).
    rowwise: the projections as one matrix-vector product per row (`_rowwise`). inv_freq: [h/2], this layer's RoPE;
    window: None, or this layer's sliding window (int32 scalar, 0 for a global layer; see `_attention`).
    in_place: cache_k/v are this layer's own buffers of a per-layer cache: the new keys and values are written into
    them (in place inside a jitted loop) and the written buffers returned.
    Returns (x_out [B, T, d], new_k [B, Hkv, T, h], new_v [B, Hkv, T, h]), or with `in_place` (x_out, cache_k, cache_v)
    [B, Hkv, S, h] each.
    """
    if isinstance(lw, FeatureMajorLayer):
        return _feature_major_layer(cfg, inv_freq, x, lw, cache_k, cache_v, cache_lengths, positions, mask, window,
                                    in_place)
    hx = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    q = _rowwise("btd,dnh->btnh", hx, lw.wq, rowwise)
    k = _rowwise("btd,dkh->btkh", hx, lw.wk, rowwise)
    v = _rowwise("btd,dkh->btkh", hx, lw.wv, rowwise)
    if lw.bq is not None:
        q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
    attn, new_k, new_v = _attend(cfg, inv_freq, q, k, v, lw.q_norm, lw.k_norm, cache_k, cache_v, cache_lengths,
                                 positions, mask, window, in_place)
    if lw.wq_gate is not None:  # Qwen3.5: each head's output gated by sigmoid(x wq_gate)
        attn = attn * jax.nn.sigmoid(_rowwise("btd,dnh->btnh", hx, lw.wq_gate, rowwise)).astype(attn.dtype)
    # the heads flattened into one contraction axis: as "btnh,nhd->btd" XLA copied a transposed wo every step
    b, t, n, h = attn.shape
    wo = lw.wo.reshape(n * h, lw.wo.shape[-1])  # [n * h, d], a bitcast of [n, h, d]
    out = _sum_shards(_rowwise("bte,ed->btd", attn.reshape(b, t, n * h), wo, rowwise), model_axis)  # [B, T, d]
    if lw.post_attn_norm is not None:
        out = rms_norm(out, lw.post_attn_norm, cfg.rms_norm_eps)
    return _mlp_block(cfg, x + out, lw, model_axis, rowwise), new_k, new_v


def _attend(cfg: ModelConfig, inv_freq, q, k, v, q_norm, k_norm, cache_k, cache_v, cache_lengths, positions, mask,
            window, in_place, cpu_kernel=False):
    """A layer's attention from its projections: q [B, T, Hq, h], k, v [B, T, Hkv, h] (biases added), then the
    query and key norms (or None), RoPE, and attention over the cache (see `_layer` for the other arguments;
    cpu_kernel: see `_attention`).
    Returns (attn [B, T, Hq, h], new_k [B, Hkv, T, h], new_v), or with `in_place` (attn, cache_k, cache_v) with the
    new entries written."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, k_norm, cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    attn = _attention(q, k, v, cache_k, cache_v, cache_lengths, mask, cfg.attention_scale, positions, window,
                      cpu_kernel)
    if not in_place:
        return attn, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # Written after the attention has read the buffers, and made to depend on that read (a zero taken from its
    # output): XLA then writes the loop-carried buffers in place. Unordered, it copied every buffer two or three times
    # a step to keep the old contents; written first and read back, it fused the write into both of its users, each
    # with its own copy (batch 1, 256 slots: 5.6 of 33 ms a step; docs/cpu-performance.md, eighth pass).
    after_read = jnp.zeros((), k.dtype) * attn[0, 0, 0, 0].astype(k.dtype)  # 0.0, once the attention has run
    return (attn, write_layer_entries(cache_k, cache_lengths, k + after_read),
            write_layer_entries(cache_v, cache_lengths, v + after_read))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FeatureMajorLayer:
    """One dense decoder layer's weights as XLA's CPU backend runs them fastest: every matrix [out, in] (q, k, v fused,
    gate and up fused), multiplying feature-major activations [in, N] (N = B x T rows) into [out, N].

    Measured on the 2-core CPU (docs/cpu-performance.md): 30 SwiGLU MLPs of SmolLM2 take 1.4x less time at 1 row and
    1.5-1.7x less at 4-16 rows than the row-major products [N, in] x [in, out] over the same weights. Made by
    `feature_major_layers` for per-layer execution on CPU; the attention in between runs on [B, T, H, h] as usual.
    """

    attn_norm: jax.Array  # [d]
    wqkv: jax.Array  # [(Hq + 2 Hkv) h, d]
    wo: jax.Array  # [d, Hq h]
    mlp_norm: jax.Array  # [d]
    w_gate_up: jax.Array  # [2f, d]: the gate's rows, then the up projection's
    w_down: jax.Array  # [d, f]
    bqkv: jax.Array | None = None  # [(Hq + 2 Hkv) h] (Qwen2)
    q_norm: jax.Array | None = None  # [h] (Qwen3, Gemma 3)
    k_norm: jax.Array | None = None  # [h]
    post_attn_norm: jax.Array | None = None  # [d] (Gemma 3)
    post_mlp_norm: jax.Array | None = None  # [d]


def feature_major_layer(lw: LayerWeights) -> FeatureMajorLayer | LayerWeights:
    """One unstacked layer's weights as a FeatureMajorLayer; a layer with experts, a gated attention output or
    linear attention is returned as it is (it runs row-major)."""
    if lw.router is not None or lw.wq_gate is not None or lw.wq is None:
        return lw
    d = lw.wq.shape[0]
    flat = lambda w: w.reshape(d, -1)  # noqa: E731  [d, H, h] -> [d, H h]
    bias = None
    if lw.bq is not None:
        bias = jnp.concatenate([lw.bq.reshape(-1), lw.bk.reshape(-1), lw.bv.reshape(-1)])
    return FeatureMajorLayer(
        attn_norm=lw.attn_norm, wqkv=jnp.concatenate([flat(lw.wq), flat(lw.wk), flat(lw.wv)], axis=1).T,
        wo=lw.wo.reshape(-1, lw.wo.shape[-1]).T, mlp_norm=lw.mlp_norm,
        w_gate_up=jnp.concatenate([lw.w_gate, lw.w_up], axis=1).T, w_down=lw.w_down.T, bqkv=bias,
        q_norm=lw.q_norm, k_norm=lw.k_norm, post_attn_norm=lw.post_attn_norm, post_mlp_norm=lw.post_mlp_norm)


def _rms_norm_features(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """rms_norm of feature-major activations x [d, N] (the features on the first axis); weight [d]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)[:, None]).astype(x.dtype)


def _feature_major_layer(cfg: ModelConfig, inv_freq, x, lw: FeatureMajorLayer, cache_k, cache_v, cache_lengths,
                         positions, mask, window, in_place):
    """`_layer` over a FeatureMajorLayer: the same inputs and outputs; inside, the activations are [d, N]."""
    b, t, d = x.shape
    hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    xt = x.reshape(b * t, d).T  # [d, N]
    qkv = feature_major_product(lw.wqkv, _rms_norm_features(xt, lw.attn_norm, cfg.rms_norm_eps))  # [(Hq + 2 Hkv) h, N]
    # kept feature-major: XLA would fold the transpose below into the product, whose transposed left operand
    # XLA:CPU's library kernel does not take (its generic loop then cost 0.6 ms a layer at 6-8 rows)
    qkv = jax.lax.optimization_barrier(qkv)
    if lw.bqkv is not None:
        qkv = qkv + lw.bqkv[:, None]
    qkv = qkv.T.reshape(b, t, hq + 2 * hkv, h)  # [B, T, Hq + 2 Hkv, h]
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    attn, new_k, new_v = _attend(cfg, inv_freq, q, k, v, lw.q_norm, lw.k_norm, cache_k, cache_v, cache_lengths,
                                 positions, mask, window, in_place, cpu_kernel=True)  # attn [B, T, Hq, h]
    out = feature_major_product(lw.wo, attn.reshape(b * t, hq * h).T)  # [d, N]
    if lw.post_attn_norm is not None:
        out = _rms_norm_features(out, lw.post_attn_norm, cfg.rms_norm_eps)
    xt = xt + out
    gate_up = feature_major_product(lw.w_gate_up, _rms_norm_features(xt, lw.mlp_norm, cfg.rms_norm_eps))  # [2f, N]
    f = gate_up.shape[0] // 2
    out = feature_major_product(lw.w_down, _activation(cfg, gate_up[:f]) * gate_up[f:])  # [d, N]
    if lw.post_mlp_norm is not None:
        out = _rms_norm_features(out, lw.post_mlp_norm, cfg.rms_norm_eps)
    return (xt + out).T.reshape(b, t, d), new_k, new_v


def _gated_mlp(cfg: ModelConfig, hx: jax.Array, w_gate, w_up, w_down, rowwise: bool = False) -> jax.Array:
    """act(hx w_gate) * (hx w_up), then w_down: the dense MLP and Qwen3.5-MoE's shared expert. hx: [B, T, d];
    w_gate, w_up: [d, f]; w_down: [f, d]. Returns [B, T, d] (this device's part when f is split over a mesh)."""
    gate = _rowwise("btd,df->btf", hx, w_gate, rowwise)
    up = _rowwise("btd,df->btf", hx, w_up, rowwise)
    return _rowwise("btf,fd->btd", _activation(cfg, gate) * up, w_down, rowwise)


def _mlp_block(cfg: ModelConfig, x: jax.Array, lw: LayerWeights, model_axis=None, rowwise: bool = False):
    """The second half of a layer: x [B, T, d] plus the MLP (or the experts) of its norm. Returns [B, T, d]."""
    hx = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
    if lw.router is not None:
        out = _sum_shards(mixture_of_experts(cfg, hx, lw, model_axis), model_axis)
        if lw.shared_down is not None:  # Qwen3.5-MoE (hybrid targets run on one device: no model axis here)
            scale = jax.nn.sigmoid(jnp.einsum("btd,d->bt", hx, lw.shared_expert_gate))[..., None]  # [B, T, 1]
            out = out + scale * _gated_mlp(cfg, hx, lw.shared_gate, lw.shared_up, lw.shared_down, rowwise)
    else:
        out = _sum_shards(_gated_mlp(cfg, hx, lw.w_gate, lw.w_up, lw.w_down, rowwise), model_axis)
    if lw.post_mlp_norm is not None:
        out = rms_norm(out, lw.post_mlp_norm, cfg.rms_norm_eps)
    return x + out


def _linear_layer(cfg: ModelConfig, x, lw: LayerWeights, conv_state, state, ancestors, chain: bool = False):
    """One linear-attention layer of a hybrid model (Qwen3.5's Gated DeltaNet), then its MLP.

    x: [B, T, d]; conv_state: [B, K-1, C] the layer's last committed conv inputs; state: [B, H, Dk, Dv] float32 its
    committed recurrent state; ancestors: bool[B, T, T] ancestor-or-self mask of the new tokens; chain: the tokens
    are a chain (ancestors is causal), run in chunks (a long prefill). Every new token reads the state along its
    own path and nothing is written: returns (x_out [B, T, d], PendingDelta for the commit).
    """
    b, t, _ = x.shape
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    hx = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    mixed = jnp.einsum("btd,dc->btc", hx, lw.lin_qkv)  # [B, T, C]: q | k | v before the conv
    gate = jnp.einsum("btd,dhv->bthv", hx, lw.lin_z)  # [B, T, H, Dv]
    beta = jax.nn.sigmoid(jnp.einsum("btd,dh->bth", hx, lw.lin_b).astype(jnp.float32))  # [B, T, H]
    a = jnp.einsum("btd,dh->bth", hx, lw.lin_a).astype(jnp.float32)
    g = -jnp.exp(lw.lin_a_log.astype(jnp.float32)) * jax.nn.softplus(a + lw.lin_dt_bias.astype(jnp.float32))
    if chain:
        conv, window = chain_conv(mixed, conv_state, lw.lin_conv)  # [B, T, C] float32
    else:
        conv, window = tree_conv(mixed, conv_state, lw.lin_conv, ancestors)
    q = conv[..., :hk * dk].reshape(b, t, hk, dk)
    k = conv[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = conv[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    # each key head serves hv / hk consecutive value heads
    q = jnp.repeat(l2_normalize(q), hv // hk, axis=2) * dk ** -0.5  # [B, T, H, Dk]
    k = jnp.repeat(l2_normalize(k), hv // hk, axis=2)
    if chain:
        out, pending = chain_gated_delta(q, k, v, g, beta, state)  # [B, T, H, Dv] float32
    else:
        out, pending = tree_gated_delta(q, k, v, g, beta, state, ancestors)
    out = rms_norm(out, lw.lin_norm, cfg.rms_norm_eps) * jax.nn.silu(gate.astype(jnp.float32))
    x = x + jnp.einsum("bthv,hvd->btd", out.astype(x.dtype), lw.lin_out)
    return _mlp_block(cfg, x, lw), dataclasses.replace(pending, window=window)


def run_hybrid_layers(cfg: ModelConfig, layers: tuple[LayerWeights, ...], x, positions, cache: KVCache | None,
                      mask, *, keep_hidden: bool = False, chain: bool = False):
    """The layers of a hybrid model (attention and linear attention, one buffer each), without touching the cache.

    layers: a tuple of every layer's LayerWeights; x: [B, T, d]; positions: int32[B, T]; cache: the committed
    context (None: none, as for a prefill); mask: bool[B, T, T] or None (one token); chain: the new tokens are a
    chain (the mask is causal): the linear-attention layers run it in chunks.
    Returns (x [B, T, d], new_k [La, B, Hkv, T, h], new_v for the La attention layers (None when there are none),
    hidden [L, B, T, d] or None, PendingDelta stacked over the linear-attention layers (None when there are none)).
    """
    b, t = x.shape[:2]
    ancestors = jnp.ones((b, 1, 1), jnp.bool_) if mask is None else mask  # [B, T, T]
    inv_freq = rope_inverse_frequencies(cfg)
    lengths = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
    new_k, new_v, hidden, pending = [], [], [], []
    for i, lw in enumerate(layers):
        if cfg.linear_layers[i]:
            j = len(pending)
            conv, state = empty_linear_state(cfg, b, x.dtype) if cache is None else (cache.conv[j], cache.state[j])
            x, p = _linear_layer(cfg, x, lw, conv, state, ancestors, chain)
            pending.append(p)
        else:
            j = len(new_k)
            ck = None if cache is None else cache.k[j]
            cv = None if cache is None else cache.v[j]
            x, nk, nv = _layer(cfg, inv_freq, x, lw, ck, cv, lengths, positions, mask)
            new_k.append(nk)
            new_v.append(nv)
        hidden.append(x)
    stacked = jax.tree.map(lambda *parts: jnp.stack(parts), *pending) if pending else None
    new_k, new_v = (jnp.stack(new) if new else None for new in (new_k, new_v))
    return x, new_k, new_v, jnp.stack(hidden) if keep_hidden else None, stacked


def layer_kinds(cfg: ModelConfig, layer_ids) -> tuple[jax.Array, jax.Array] | None:
    """What differs between the layers of a model with sliding-window layers (Gemma 3), for the layers `layer_ids`
    (int32[Lr], their indices in the model): (inv_freq [Lr, h/2] their RoPE, window int32[Lr] their sliding window,
    0 for a global layer). None for a model whose layers are all alike."""
    if not any(cfg.sliding_layers):
        return None
    sliding = jnp.asarray(np.array(cfg.sliding_layers))[layer_ids]  # bool[Lr]
    inv_freq = jnp.where(sliding[:, None], rope_inverse_frequencies(cfg, sliding=True),
                         rope_inverse_frequencies(cfg))  # [Lr, h/2]
    return inv_freq, jnp.where(sliding, cfg.sliding_window, 0).astype(jnp.int32)


def run_layers(cfg: ModelConfig, layers: LayerWeights, x, positions, cache_k, cache_v, cache_lengths, mask, *,
               keep_hidden: bool = False, model_axis: str | None = None, layer_ids=None):
    """Runs a stack of layers (a scan over their leading axis, or a loop over a tuple of unstacked layers) without
    touching the cache.

    layers: LayerWeights with a leading axis Lr, or a tuple of Lr LayerWeights (`unstack_layers`); x: [B, T, d];
    positions: int32[B, T]; cache_k, cache_v:
    [Lr, B, Hkv, S, h], a tuple of Lr [B, Hkv, S, h] (a per-layer cache), or None; cache_lengths: int32[B] (slots
    visible per row); mask: bool[B, T, T] or None.
    model_axis: inside shard_map, the mesh axis the heads and f are split over (see `_layer`).
    layer_ids: int32[Lr], the layers' indices in the model (which of them slide, for Gemma 3); default 0 .. Lr-1.
    Returns (x [B, T, d], new_k [Lr, B, Hkv, T, h], new_v, hidden [Lr, B, T, d] or None: every layer's output).
    """
    inv_freq = rope_inverse_frequencies(cfg)
    num_layers = len(layers) if isinstance(layers, tuple) else layers.attn_norm.shape[0]
    kinds = layer_kinds(cfg, np.arange(num_layers) if layer_ids is None else layer_ids)  # None or ([Lr, h/2], [Lr])
    if isinstance(layers, tuple):  # one buffer per layer: no per-step copy of each layer's slice (CPU)
        b, t = x.shape[:2]
        rowwise = 1 < b * t <= ROWWISE_MAX_ROWS
        new_k, new_v, hidden = [], [], []
        for i, lw in enumerate(layers):
            ck = None if cache_k is None else cache_k[i]
            cv = None if cache_v is None else cache_v[i]
            freq, window = (inv_freq, None) if kinds is None else (kinds[0][i], kinds[1][i])
            x, nk, nv = _layer(cfg, freq, x, lw, ck, cv, cache_lengths, positions, mask, model_axis, rowwise,
                               window)
            new_k.append(nk)
            new_v.append(nv)
            hidden.append(x)
        return x, jnp.stack(new_k), jnp.stack(new_v), jnp.stack(hidden) if keep_hidden else None

    def body(x, per_layer):
        lw, ck, cv, kind = per_layer
        freq, window = (inv_freq, None) if kind is None else kind
        x, nk, nv = _layer(cfg, freq, x, lw, ck, cv, cache_lengths, positions, mask, model_axis, window=window)
        return x, (nk, nv, x if keep_hidden else None)

    if isinstance(cache_k, tuple):  # a per-layer cache with stacked weights: scanned as one stack (a copy)
        cache_k, cache_v = jnp.stack(cache_k), jnp.stack(cache_v)
    x, (new_k, new_v, hidden) = jax.lax.scan(body, x, (layers, cache_k, cache_v, kinds))
    return x, new_k, new_v, hidden


def run_layers_in_place(cfg: ModelConfig, layers: tuple[LayerWeights, ...], x, positions, cache: KVCache, mask, *,
                        keep_hidden: bool = False):
    """Runs per-layer weights over a per-layer cache, each layer writing its new keys and values into its own buffer
    once it has attended over it (`_layer` with `in_place`): in a jitted loop the buffers are updated in place.

    layers: a tuple of Lr LayerWeights; x: [B, T, d]; positions: int32[B, T]; cache: a per-layer KVCache of Lr
    layers; mask: bool[B, T, T] or None (one token). Returns (x [B, T, d], the cache with the new entries written
    and `lengths` unchanged, hidden [Lr, B, T, d] or None).
    """
    inv_freq = rope_inverse_frequencies(cfg)
    b, t = x.shape[:2]
    rowwise = 1 < b * t <= ROWWISE_MAX_ROWS
    keys, values, hidden = [], [], []
    for lw, ck, cv in zip(layers, cache.k, cache.v, strict=True):
        x, ck, cv = _layer(cfg, inv_freq, x, lw, ck, cv, cache.lengths, positions, mask, rowwise=rowwise,
                           in_place=True)
        keys.append(ck)
        values.append(cv)
        hidden.append(x)
    cache = dataclasses.replace(cache, k=tuple(keys), v=tuple(values))
    return x, cache, jnp.stack(hidden) if keep_hidden else None


ROWWISE_MAX_ROWS = 4  # unstacked layers: up to this many rows (batch x tokens) as separate matrix-vector products


def unstack_layers(weights: Weights) -> Weights:
    """The same weights with one buffer per layer: `layers` a tuple of per-layer LayerWeights.

    On XLA's CPU backend a scan over stacked layers copies every layer's weights out of the stack before each
    matrix product (a dynamic slice feeding a library kernel), which made most of a batch-1 decoding step; separate
    buffers are read in place (docs/cpu-performance.md). The forward unrolls the layers (longer compilation).
    The generation functions do this on CPU themselves (`execution_weights`); already unstacked weights pass.
    """
    if isinstance(weights.layers, tuple):
        return weights
    return dataclasses.replace(weights, layers=tuple(_each_layer(weights.layers)))


def _each_layer(layers: LayerWeights | tuple):
    """The layers one at a time: a tuple's own, or each layer of a stack as a copy made when it is reached."""
    if isinstance(layers, tuple):
        yield from layers
        return
    for i in range(layers.attn_norm.shape[0]):
        yield jax.tree.map(lambda w, i=i: w[i], layers)


def _laid_out(weights: Weights, convert_layer) -> Weights:
    """The weights with convert_layer(each layer), the layers taken out of a stack one at a time and each copy
    dropped once converted (memory holds the stacked weights and the converted ones, never a third, unstacked copy
    besides: for Qwen2.5-Coder-1.5B, loaded and laid out in one process, the peak went from 20.4 to 15.5 GB), and
    the output matrix's bfloat16 screen (`head_screen`)."""
    converted = tuple(jax.block_until_ready(convert_layer(lw)) for lw in _each_layer(weights.layers))
    return dataclasses.replace(weights, layers=converted, head_screen=head_screen(weights))


def feature_major_layers(weights: Weights) -> Weights:
    """The weights unstacked with every dense layer as a FeatureMajorLayer (the CPU layout), and a float32 output
    matrix's bfloat16 screen (`head_screen`), converted one layer at a time (`_laid_out`)."""
    return _laid_out(weights, feature_major_layer)


def _bfloat16_layer(lw: LayerWeights) -> FeatureMajorLayer | LayerWeights:
    """`feature_major_layer` with its matrices rounded to bfloat16 (a layer that stays row-major is kept)."""
    lw = feature_major_layer(lw)
    if not isinstance(lw, FeatureMajorLayer):
        return lw
    return dataclasses.replace(lw, **{name: getattr(lw, name).astype(jnp.bfloat16)
                                      for name in ("wqkv", "wo", "w_gate_up", "w_down")})


def bfloat16_feature_major_layers(weights: Weights) -> Weights:
    """`feature_major_layers` with every FeatureMajorLayer's matrices, and the LM head's rows where the layout screens
    them (`HeadScreen`, whose bfloat16 matrix then also gives the logits), rounded to bfloat16: a draft model read at
    half the bytes per drafted token. `feature_major_product` widens them exactly in registers (with jaxspec's CPU
    kernels), so the forward computes in float32 what the rounded matrices give; the norms, biases and the embedding
    stay float32. For drafters only: rounding moves the model's outputs a little, which may change which drafts the
    target accepts, never what it emits."""
    weights = _laid_out(weights, _bfloat16_layer)
    screen = weights.head_screen  # the LM head's rows, rounded already: the screen's matrix (None: no screen, kept)
    return dataclasses.replace(weights, head_screen=None if screen is None else dataclasses.replace(
        screen, rows=screen.matrix))


def _stored_rows(weights: Weights) -> jax.Array | None:
    """The LM head's [V, d] rows where they are stored as such (the rows the CPU layout's `HeadScreen` keeps: of an
    untied head, or a rounded draft model's; else the embedding when tied); None where only lm_head [d, V] is."""
    if weights.head_screen is not None and weights.head_screen.rows is not None:
        return weights.head_screen.rows
    return weights.embed if weights.lm_head is None else None


def output_matrix(weights: Weights) -> jax.Array:
    """The LM head as [V, d] rows, one per token: the stored rows (`_stored_rows`), else lm_head transposed."""
    rows = _stored_rows(weights)
    return weights.lm_head.T if rows is None else rows


def head_screen(weights: Weights) -> HeadScreen | None:
    """The bfloat16 screen of a float32 output matrix (`HeadScreen`), its error bound computed in float64; None for
    other dtypes, off CPU, or where the few-column kernel is off ($JAXSPEC_SMALL_PRODUCT=off, or it cannot build)."""
    rows = output_matrix(weights)  # [V, d]
    if (rows.dtype != jnp.float32 or rows.shape[0] <= SCREEN_CANDIDATES or jax.default_backend() != "cpu"
            or not kernels_on()):
        return None
    matrix = rows.astype(jnp.bfloat16)  # [V, d]
    rounding = norm = 0.0  # max over rows of ||matrix_v - E_v||^2 and of ||E_v||^2, ||matrix_v||^2
    for start in range(0, rows.shape[0], 4096):  # in float64, 4096 rows at a time
        exact = np.asarray(rows[start: start + 4096], np.float64)  # [<=4096, d]
        screened = np.asarray(matrix[start: start + 4096].astype(jnp.float32), np.float64)
        rounding = max(rounding, float(np.max(np.sum((screened - exact) ** 2, axis=1))))
        norm = max(norm, float(np.max(np.sum(exact ** 2, axis=1))), float(np.max(np.sum(screened ** 2, axis=1))))
    d, unit = rows.shape[1], 2.0 ** -24
    gamma = d * unit / (1 - d * unit)
    error = np.sqrt(rounding) + 2 * gamma * np.sqrt(norm)
    return HeadScreen(matrix=matrix, error=jnp.asarray(error, jnp.float32),
                      rows=None if weights.lm_head is None else rows)


def select_layers(layers: LayerWeights | tuple[LayerWeights, ...], start: int, end: int):
    """Layers [start, end) of a stacked LayerWeights or of a tuple of unstacked ones."""
    if isinstance(layers, tuple):
        return layers[start:end]
    return jax.tree.map(lambda w: w[start:end], layers)


_EXECUTION_WEIGHTS: dict[tuple[int, Any], tuple[Any, Any]] = {}  # `converted_once`


LAYERS_ENV = "JAXSPEC_LAYERS"  # "unstacked": run the layers as per-layer buffers on CPU (see `execution_weights`)


@contextlib.contextmanager
def layers_layout(layout: str):
    """Runs the block with $JAXSPEC_LAYERS set to `layout` ("stacked" or "unstacked"), restoring what it was after
    (a command that sets it must not change the layout of everything run later in the same process)."""
    if layout not in ("stacked", "unstacked"):
        raise ValueError(f"layout must be 'stacked' or 'unstacked', got {layout!r}")
    before = os.environ.get(LAYERS_ENV)
    os.environ[LAYERS_ENV] = layout
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAYERS_ENV, None)
        else:
            os.environ[LAYERS_ENV] = before


def runs_per_layer(mesh=None) -> bool:
    """Whether the generation functions run per-layer, feature-major weights: on CPU, without a mesh, when the
    environment says JAXSPEC_LAYERS=unstacked (`execution_weights`)."""
    return (os.environ.get(LAYERS_ENV, "stacked") == "unstacked" and mesh is None
            and jax.default_backend() == "cpu")


def converted_once(source, convert):
    """convert(source), kept for the last three conversions (by the source's identity and the conversion): repeated
    calls with the same weights convert once, and at most three converted copies (a target, a draft model, a head)
    stay alive, each doubling that model's memory. `convert`: a module-level function (its identity is the key)."""
    key = (id(source), convert)
    cached = _EXECUTION_WEIGHTS.get(key)
    if cached is not None and cached[0] is source:
        return cached[1]
    converted = jax.block_until_ready(convert(source))
    if len(_EXECUTION_WEIGHTS) >= 3:
        _EXECUTION_WEIGHTS.pop(next(iter(_EXECUTION_WEIGHTS)))
    _EXECUTION_WEIGHTS[key] = (source, converted)
    return converted


def execution_weights(weights: Weights, mesh=None) -> Weights:
    """The weights as the generation functions run them: on CPU without a mesh, per-layer and feature-major when
    the environment says JAXSPEC_LAYERS=unstacked (`feature_major_layers`; the generation loops then make a per-layer
    cache; the last two conversions are kept, so repeated calls with the same weights convert once); as they are
    otherwise (accelerators fuse the slice of a scanned stack into the matrix product).

    This layout makes a CPU decoding step 1.25x faster at batch 1 and 2x at batch 16, and verification of 4-16 tokens
    1.4-2x faster (docs/cpu-performance.md), but compiles 4-5x longer (the 30 layers of SmolLM2 unrolled: 17-26 s
    instead of 5 s for the autoregressive loop), so it pays on long jobs (`jaxspec regenerate` sets it unless told
    otherwise, `jaxspec bench` runs) and not on one short generation or the test suite.
    """
    if not runs_per_layer(mesh) or isinstance(weights.layers, tuple):
        return weights
    return converted_once(weights, feature_major_layers)


def embed_tokens(weights: Weights, cfg: ModelConfig, tokens: jax.Array, model_axis: str | None = None) -> jax.Array:
    """tokens: int32[B, T] -> [B, T, d], scaled by the config's embedding multiplier (Gemma). With the embedding's
    vocabulary split over `model_axis` (inside shard_map) each device looks up the tokens in its slice and the rows
    are summed over the axis."""
    if model_axis is None:
        rows = jnp.take(weights.embed, tokens, axis=0)  # [B, T, d]
    else:
        local_size = weights.embed.shape[0]
        local = tokens - jax.lax.axis_index(model_axis) * local_size  # [B, T]
        inside = (local >= 0) & (local < local_size)
        rows = jnp.take(weights.embed, jnp.clip(local, 0, local_size - 1), axis=0)  # [B, T, d]
        rows = jax.lax.psum(jnp.where(inside[..., None], rows, 0), model_axis)
    if cfg.embedding_multiplier != 1.0:
        rows = rows * jnp.asarray(cfg.embedding_multiplier, rows.dtype)
    return rows


def lm_head(weights: Weights, cfg: ModelConfig, x: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
    """x: [B, T, d] residual stream -> float32 logits [B, T, V] (final norm, then the output projection).

    vocab: int32[Vs] token ids -> only their logits [B, T, Vs] (a drafter's reduced vocabulary: Vs/V of the cost).
    """
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    if vocab is not None and weights.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, jnp.take(weights.embed, vocab, axis=0), preferred_element_type=jnp.float32)
    if vocab is not None:
        columns = jnp.take(weights.lm_head, vocab, axis=1)  # [d, Vs]
        return jnp.einsum("btd,dv->btv", x, columns, preferred_element_type=jnp.float32)
    # one product for any number of rows: the output matrix (113 MB for SmolLM2 in float32) does not stay in the
    # cache between 1-row products, so `_rowwise` read it once a row (2-4 rows: 1.3-1.8x slower than one product)
    rows = _stored_rows(weights)  # [V, d] or None
    if isinstance(weights.layers, tuple) and rows is not None and rows.dtype in (jnp.float32, jnp.bfloat16):
        b, t, d = x.shape  # per-layer (CPU): the rows [V, d] are the [out, in] matrix the few-token kernel takes
        logits = feature_major_product(rows, x.reshape(b * t, d).T)  # [V, N]
        return logits.T.reshape(b, t, -1)
    if weights.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, weights.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, weights.lm_head, preferred_element_type=jnp.float32)


def screens_head(weights: Weights, positions: int) -> bool:
    """Whether `greedy_tokens` reads the LM head's bfloat16 screen for this many positions (batch x tokens): with a
    `HeadScreen` (the CPU layout) and at most the kernel's MAX_COLUMNS (beyond them the product is compute-bound)."""
    return weights.head_screen is not None and positions <= MAX_COLUMNS


def draws_through_screen(weights: Weights, sampling: SamplingConfig, positions: int) -> bool:
    """Whether the decoding loops draw tokens under a (non-greedy) `sampling` by `greedy_tokens` with Gumbel noise:
    a temperature alone (`draws_by_argmax`) and the screen running for these positions (`screens_head`). Elsewhere
    the full logits are computed anyway, and one uniform a row (`sample_token`) costs less than a Gumbel variate per
    token (1 ms for 49k on XLA:CPU)."""
    return draws_by_argmax(sampling) and screens_head(weights, positions)


def greedy_tokens(weights: Weights, cfg: ModelConfig, x: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """The argmax of `lm_head(weights, cfg, x)` (+ `noise` when given) over the vocabulary (the lowest id among equal
    maxima): x: [B, T, d] residual stream, noise: float32[B, T, V] or None -> int32[B, T]. With noise = temperature
    x Gumbel noise (`jaxspec.sampling.gumbel_noise`) the argmax is a sample of softmax(logits / temperature).

    With a `HeadScreen` (the CPU layout, at most 16 positions) the kernel `jaxspec.kernels.greedy_head` reads the
    bfloat16 copy instead of the float32 matrix: screened logits for every token, the SCREEN_CANDIDATES best scored
    again in float32 from their rows, and the best of those is the argmax whenever the next screened logit plus the
    screen's error bound stays below it (then no other token can reach it); where that is not certain, every
    token's float32 logit decides. The noise goes with each logit through all three."""
    b, t, d = x.shape
    screen = weights.head_screen
    if not screens_head(weights, b * t):
        logits = lm_head(weights, cfg, x)  # [B, T, V]
        return jnp.argmax(logits if noise is None else logits + noise, axis=-1).astype(jnp.int32)
    h = rms_norm(x, weights.final_norm, cfg.rms_norm_eps).reshape(b * t, d)  # [N, d]
    flat_noise = None if noise is None else noise.reshape(b * t, -1).astype(jnp.float32)  # [N, V]
    return greedy_head(screen.matrix, output_matrix(weights), h, screen.error, flat_noise).reshape(b, t)


# ---------------------------------------------------------------------------------------------- forward


def forward(
    weights: Weights,
    cfg: ModelConfig,
    tokens: jax.Array | None,
    positions: jax.Array,
    cache: KVCache | None = None,
    mask: jax.Array | None = None,
    *,
    hidden_layers: tuple[int, ...] = (),
    layer_range: tuple[int, int] | None = None,
    hidden_in: jax.Array | None = None,
    compute_logits: bool = True,
    model_axis: str | None = None,
    read_cache: bool = True,
) -> ForwardOutput:
    """Runs the decoder on T new tokens per row.

    Args:
        weights: the model's weights.
        cfg: its config (static).
        tokens: int32[B, T] new tokens; None when the range starts after layer 0 (then `hidden_in` is used).
        positions: int32[B, T] RoPE positions of the new tokens.
        cache: committed context; the new tokens attend to its slots [0, lengths[b]) and their keys and
            values are written at [lengths[b], lengths[b] + T) for the layers run. None: no context.
        mask: bool[B, T, T], which new tokens each new token sees (causal for prefill and decode, a tree's
            ancestor mask for verification). Default (None): causal, and a hybrid model's linear-attention layers
            then run the tokens as a chain, in chunks (`jaxspec.gated_delta.chain_gated_delta`).
        hidden_layers: indices i of the layers whose output (residual stream after layer i) to return.
            They must lie in the range run.
        layer_range: (start, end) to run only layers [start, end); default all.
        hidden_in: [B, T, d] input residual stream when start > 0.
        compute_logits: whether to apply the final norm and LM head (only when end == num_layers).
        model_axis: inside shard_map, the mesh axis the heads, f and the vocabulary are split over; the
            weights and cache are then this device's slices and the logits its vocabulary slice [B, T, V_local].
            Call it through `jaxspec.sharding.forward_on_mesh`.
        read_cache: False when the cache is known to be empty (a prefill): the new tokens attend only to each
            other and are still written to it. Saves the work over S empty slots, and keeps XLA from
            constant-folding the softmax over a freshly made cache at compile time (minutes at batch 64).

    Returns:
        ForwardOutput with logits [B, T, V], hidden [n, B, T, d], last_hidden [B, T, d] and the cache.
    """
    start, end = layer_range if layer_range is not None else (0, cfg.num_layers)
    if not 0 <= start < end <= cfg.num_layers:
        raise ValueError(f"layer_range {layer_range} is not within [0, {cfg.num_layers}].")
    for i in hidden_layers:
        if not start <= i < end:
            raise ValueError(f"hidden layer {i} is outside the layer range [{start}, {end}).")
    if start == 0:
        x = embed_tokens(weights, cfg, tokens, model_axis)
    else:
        if hidden_in is None:
            raise ValueError("hidden_in is required when the layer range starts after layer 0.")
        x = hidden_in
    b, t = positions.shape
    chain = mask is None  # the default mask: the new tokens form a chain
    if mask is None and t > 1:
        mask = causal_mask(b, t)
    layers = select_layers(weights.layers, start, end)

    keep_hidden = bool(hidden_layers)
    pending = new_cache = None
    if cfg.is_hybrid:
        if (start, end) != (0, cfg.num_layers) or model_axis is not None or not isinstance(layers, tuple):
            raise ValueError("A hybrid model runs all its layers at once, on one device, from per-layer weights.")
        x, new_k, new_v, all_hidden, pending = run_hybrid_layers(
            cfg, layers, x, positions, cache if cache is not None and read_cache else None, mask,
            keep_hidden=keep_hidden, chain=chain)
    elif (cache is not None and read_cache and cache.per_layer and isinstance(layers, tuple) and model_axis is None
          and (start, end) == (0, cfg.num_layers) and not any(cfg.sliding_layers)):
        x, new_cache, all_hidden = run_layers_in_place(cfg, layers, x, positions, cache, mask, keep_hidden=keep_hidden)
    else:
        if cache is not None and read_cache:
            cache_lengths = cache.lengths
            layer_cache = (cache.k[start:end], cache.v[start:end])  # [Lr, B, Hkv, S, h] each
        else:
            cache_lengths = jnp.zeros((b,), jnp.int32)
            layer_cache = (None, None)
        x, new_k, new_v, all_hidden = run_layers(cfg, layers, x, positions, *layer_cache, cache_lengths, mask,
                                                 keep_hidden=keep_hidden, model_axis=model_axis,
                                                 layer_ids=np.arange(start, end))
    hidden = None
    if keep_hidden:
        hidden = all_hidden[jnp.array([i - start for i in hidden_layers])]  # [n, B, T, d]
    if new_cache is None and cache is not None:
        new_cache = write_new_entries(cache, new_k, new_v, layer_start=start)
    logits = lm_head(weights, cfg, x) if (compute_logits and end == cfg.num_layers) else None
    return ForwardOutput(logits=logits, hidden=hidden, last_hidden=x, cache=new_cache, pending=pending)


def init_weights(cfg: ModelConfig, key: jax.Array, scale: float = 0.02, dtype=jnp.float32) -> Weights:
    """Random weights (normal(0, scale) matrices, norms at 1) for tests and freshly initialised drafters."""
    num_layers, d, f, h = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hk = cfg.num_heads, cfg.num_kv_heads
    keys = iter(jax.random.split(key, 20))

    def normal(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    def ones(*shape):
        return jnp.ones(shape, dtype)

    e, fe = cfg.num_experts, cfg.moe_intermediate_size
    dense = not e
    layers = LayerWeights(
        attn_norm=ones(num_layers, d), wq=normal(num_layers, d, hq, h), wk=normal(num_layers, d, hk, h),
        wv=normal(num_layers, d, hk, h), wo=normal(num_layers, hq, h, d), mlp_norm=ones(num_layers, d),
        w_gate=normal(num_layers, d, f) if dense else None, w_up=normal(num_layers, d, f) if dense else None,
        w_down=normal(num_layers, f, d) if dense else None,
        router=None if dense else normal(num_layers, d, e),
        expert_gate=None if dense else normal(num_layers, e, d, fe),
        expert_up=None if dense else normal(num_layers, e, d, fe),
        expert_down=None if dense else normal(num_layers, e, fe, d),
        bq=normal(num_layers, hq, h) if cfg.attention_bias else None,
        bk=normal(num_layers, hk, h) if cfg.attention_bias else None,
        bv=normal(num_layers, hk, h) if cfg.attention_bias else None,
        q_norm=ones(num_layers, h) if cfg.qk_norm else None,
        k_norm=ones(num_layers, h) if cfg.qk_norm else None,
        post_attn_norm=ones(num_layers, d) if cfg.sandwich_norms else None,
        post_mlp_norm=ones(num_layers, d) if cfg.sandwich_norms else None,
        wq_gate=normal(num_layers, d, hq, h) if cfg.attention_output_gate else None,
    )
    fs = cfg.shared_expert_intermediate_size
    if fs:
        layers = dataclasses.replace(layers, shared_gate=normal(num_layers, d, fs), shared_up=normal(num_layers, d, fs),
                                     shared_down=normal(num_layers, fs, d), shared_expert_gate=normal(num_layers, d))
    if cfg.is_hybrid:  # one LayerWeights per layer: a linear-attention layer's own weights replace attention's
        c, hv, dv, kernel = (cfg.linear_conv_channels, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                             cfg.linear_conv_kernel)
        lin = iter(jax.random.split(next(keys), 6 * num_layers))

        def lin_normal(*shape, std=scale):
            return (std * jax.random.normal(next(lin), shape)).astype(dtype)

        per_layer = []
        for i in range(num_layers):
            layer = jax.tree.map(lambda w, i=i: w[i], layers)
            if cfg.linear_layers[i]:
                layer = dataclasses.replace(
                    layer, wq=None, wk=None, wv=None, wo=None, q_norm=None, k_norm=None, wq_gate=None,
                    lin_qkv=lin_normal(d, c), lin_z=lin_normal(d, hv, dv), lin_b=lin_normal(d, hv),
                    lin_a=lin_normal(d, hv), lin_conv=lin_normal(c, kernel, std=0.3),
                    lin_dt_bias=jnp.ones((hv,), dtype), lin_a_log=jnp.zeros((hv,), dtype), lin_norm=ones(dv),
                    lin_out=lin_normal(hv, dv, d))
            per_layer.append(layer)
        layers = tuple(per_layer)
    return Weights(embed=normal(cfg.vocab_size, d), layers=layers, final_norm=ones(d),
                   lm_head=None if cfg.tie_word_embeddings else normal(d, cfg.vocab_size))
