"""Static key/value cache: one buffer per key and value for all layers, and a committed length per batch row.

Slots [0, lengths[b]) of row b hold committed tokens. A forward writes its T new tokens at
[lengths[b], lengths[b] + T) without advancing `lengths`; the caller commits what it keeps (one decoded
token, a prompt, an accepted draft path). Anything written beyond `lengths` is invisible to later
attention and is overwritten by the next write, which is how rejected draft tokens disappear.

A hybrid model (Qwen3.5) keeps keys and values for its attention layers only, and for each linear-attention layer
a conv state (its last K-1 inputs) and a recurrent state. A forward writes no recurrent state: it returns what the
commit needs (`jaxspec.gated_delta.PendingDelta`), and `commit_recurrent` moves each row's state to the last token
it keeps, the way `commit_positions` moves the kept keys and values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.gated_delta import conv_state_after, state_after


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """k, v: [L, B, Hkv, S, D] (L: the attention layers), or tuples of L per-layer buffers [B, Hkv, S, D] (made for
    per-layer weights, `init_cache(per_layer=True)`); lengths: int32[B] (committed tokens per row); for a hybrid
    model conv [Lg, B, K-1, C] and state [Lg, B, H, Dk, Dv] float32 of its Lg linear-attention layers (else None).

    Per-layer buffers exist for XLA's CPU backend: a layer's attention reads its own buffer in place, where a slice
    of the stacked buffer (static or in a scan) is copied before the product, the whole cache every step
    (docs/cpu-performance.md). `cache.k[i]` is layer i's [B, Hkv, S, D] and `cache.k[a:b]` a range in both forms."""

    k: jax.Array | tuple[jax.Array, ...]  # [L, B, Hkv, S, D] or L x [B, Hkv, S, D]
    v: jax.Array | tuple[jax.Array, ...]  # [L, B, Hkv, S, D] or L x [B, Hkv, S, D]
    lengths: jax.Array  # int32[B]
    conv: jax.Array | None = None  # [Lg, B, K-1, C]
    state: jax.Array | None = None  # [Lg, B, H, Dk, Dv] float32

    @property
    def max_length(self) -> int:
        """S, the number of slots per row."""
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int, dtype=jnp.float32, num_layers=None,
               per_layer: bool = False) -> KVCache:
    """An empty cache of `max_length` slots per row (num_layers defaults to the model's attention layers), with the
    zero conv and recurrent states of a hybrid model's linear-attention layers; with `per_layer`, keys and values
    as one buffer per layer (for per-layer weights, `jaxspec.model.execution_weights`)."""
    linear = sum(cfg.linear_layers) if num_layers is None else 0  # a drafter's own cache of num_layers has none
    num_layers = cfg.num_attention_layers if num_layers is None else num_layers
    shape = (num_layers, batch_size, cfg.num_kv_heads, max_length, cfg.head_dim)
    conv = state = None
    if linear:
        conv, state = (jnp.broadcast_to(a, (linear, *a.shape)) for a in empty_linear_state(cfg, batch_size, dtype))
    if per_layer:
        k = tuple(jnp.zeros(shape[1:], dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape[1:], dtype) for _ in range(num_layers))
    else:
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32), conv=conv, state=state)


def empty_linear_state(cfg: ModelConfig, batch_size: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """One linear-attention layer's states before any token: conv [B, K-1, C] and recurrent [B, H, Dk, Dv] float32."""
    return (jnp.zeros((batch_size, cfg.linear_conv_kernel - 1, cfg.linear_conv_channels), dtype),
            jnp.zeros((batch_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32))


def replace_rows(cache: KVCache, rows: jax.Array, new: KVCache) -> KVCache:
    """The cache with rows `rows` (int32[R]) replaced by the R rows of `new` (the same slots and layers; rows equal to
    the batch size are dropped, so a group can be padded): how continuous batching starts new prompts in freed rows."""

    def put(buffer, fresh, axis):  # the batch axis of buffer and fresh
        if buffer is None:
            return None
        if isinstance(buffer, tuple):
            return tuple(put(b, f, axis) for b, f in zip(buffer, fresh, strict=True))
        index = (slice(None),) * axis + (rows,)
        return buffer.at[index].set(fresh.astype(buffer.dtype), mode="drop")

    layer_axis = 0 if cache.per_layer else 1  # per-layer buffers [B, ...], stacked ones [L, B, ...]
    return KVCache(k=put(cache.k, new.k, layer_axis), v=put(cache.v, new.v, layer_axis),
                   lengths=put(cache.lengths, new.lengths, 0), conv=put(cache.conv, new.conv, 1),
                   state=put(cache.state, new.state, 1))


def _row_slots(lengths: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index arrays for (row, slot) pairs: rows int32[B, 1] and slots lengths[b] + offsets int32[B, T]."""
    rows = jnp.arange(lengths.shape[0], dtype=jnp.int32)[:, None]  # [B, 1]
    return rows, lengths[:, None] + offsets  # [B, 1], [B, T]


def write_layer_entries(buffer: jax.Array, lengths: jax.Array, new: jax.Array) -> jax.Array:
    """One layer's buffer [B, Hkv, S, D] of a per-layer cache with T new entries per row, new [B, T, Hkv, D], written
    at [lengths[b], lengths[b] + T) (one scatter in the buffer's layout: in place inside a jitted loop)."""
    rows, slots = _row_slots(lengths, jnp.arange(new.shape[1], dtype=jnp.int32)[None, :])  # [B, 1], [B, T]
    return buffer.at[rows, :, slots].set(new.astype(buffer.dtype), mode="drop", unique_indices=True)


def write_new_entries(cache: KVCache, new_k: jax.Array, new_v: jax.Array, layer_start: int = 0) -> KVCache:
    """Writes T new entries per row at [lengths[b], lengths[b] + T) for a contiguous range of layers.

    One scatter per buffer, indexed by (row, slot) and keeping the buffer's layout, so that inside a jitted loop
    XLA updates the cache in place (a per-row vmap of dynamic_update_slice made it transpose and copy the whole
    cache every step).

    Args:
        new_k, new_v: [Lr, B, Hkv, T, D] for layers [layer_start, layer_start + Lr).
    Returns the cache with the entries written and `lengths` unchanged.
    """
    num_layers, _, _, t, _ = new_k.shape
    rows, slots = _row_slots(cache.lengths, jnp.arange(t, dtype=jnp.int32)[None, :])
    layers = slice(layer_start, layer_start + num_layers)

    def write(buffer, new):  # buffer [L, B, Hkv, S, D] (or L x [B, Hkv, S, D]), new [Lr, B, Hkv, T, D]
        if isinstance(buffer, tuple):
            written = tuple(write_layer_entries(buffer[layer_start + j], cache.lengths, new[j].transpose(0, 2, 1, 3))
                            for j in range(num_layers))
            return buffer[:layer_start] + written + buffer[layer_start + num_layers:]
        updates = new.transpose(1, 3, 0, 2, 4).astype(buffer.dtype)  # [B, T, Lr, Hkv, D]: advanced indices first
        return buffer.at[layers, rows, :, slots].set(updates, mode="drop", unique_indices=True)

    return dataclasses.replace(cache, k=write(cache.k, new_k), v=write(cache.v, new_v))


def commit_positions(cache: KVCache, source_offsets: jax.Array, num_accepted: jax.Array,
                     chain: bool = False) -> KVCache:
    """Moves accepted entries into place and advances each row's length.

    After a verification forward wrote T entries at [len, len + T), entry `source_offsets[b, i]` (an index
    in [0, T)) becomes committed slot len + i for i < num_accepted[b]. One gather and one scatter per buffer,
    in the buffer's layout (in place inside a jitted loop).

    Args:
        source_offsets: int32[B, A], the accepted path's node indices in order (A <= T; padded arbitrarily).
        num_accepted: int32[B], how many of them to keep.
        chain: the offsets are 0, 1, 2, ... (a chain drafter, `Drafter.chain`): the entries are in place already and
            only the lengths advance (no gather or scatter: in the per-layer layout they were 2 x L small ops a round).
    """
    if chain:
        return dataclasses.replace(cache, lengths=cache.lengths + num_accepted.astype(jnp.int32))
    a = source_offsets.shape[1]
    rows, sources = _row_slots(cache.lengths, source_offsets.astype(jnp.int32))
    _, targets = _row_slots(cache.lengths, jnp.arange(a, dtype=jnp.int32)[None, :])
    # Slots past num_accepted are left alone: their targets point out of range and are dropped.
    keep = jnp.arange(a)[None, :] < num_accepted[:, None]  # [B, A]
    targets = jnp.where(keep, targets, cache.max_length)

    def move(buffer):  # [L, B, Hkv, S, D] (or L x [B, Hkv, S, D])
        if isinstance(buffer, tuple):
            return tuple(layer.at[rows, :, targets].set(layer[rows, :, sources], mode="drop") for layer in buffer)
        moved = buffer[:, rows, :, sources]  # [B, A, L, Hkv, D]
        return buffer.at[:, rows, :, targets].set(moved, mode="drop")

    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v),
                               lengths=cache.lengths + num_accepted.astype(jnp.int32))


def commit_recurrent(cache: KVCache, pending, path: jax.Array, count: jax.Array) -> KVCache:
    """Moves a hybrid model's linear-attention states to the last kept token of each row; a no-op otherwise.

    pending: the forward's `PendingDelta` stacked over the Lg linear-attention layers (None: not a hybrid model);
    path: int32[B, A], the kept tokens' indices among the forward's new tokens, first (the root) first: a chain of
    the tree; count: int32[B], how many of them are kept (0 keeps the state). Lengths are not touched.
    """
    if pending is None:
        return cache
    state = jax.vmap(state_after, in_axes=(0, 0, None, None))(cache.state, pending, path, count)
    conv = jax.vmap(conv_state_after, in_axes=(0, 0, None, None))(cache.conv, pending, path, count)
    return dataclasses.replace(cache, conv=conv.astype(cache.conv.dtype), state=state)
