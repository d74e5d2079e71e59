"""Static key/value cache: one buffer per key and value for all layers, and a committed length per batch row.

Slots [0, lengths[b]) of row b hold committed tokens. A forward writes its T new tokens at
[lengths[b], lengths[b] + T) without advancing `lengths`; the caller commits what it keeps (one decoded
token, a prompt, an accepted draft path). Anything written beyond `lengths` is invisible to later
attention and is overwritten by the next write, which is how rejected draft tokens disappear.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """k, v: [L, B, Hkv, S, D]; lengths: int32[B] (committed tokens per row)."""

    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    lengths: jax.Array  # int32[B]

    @property
    def max_length(self) -> int:
        """S, the number of slots per row."""
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int, dtype=jnp.float32, num_layers=None) -> KVCache:
    """An empty cache of `max_length` slots per row (num_layers defaults to the model's)."""
    num_layers = cfg.num_layers if num_layers is None else num_layers
    shape = (num_layers, batch_size, cfg.num_kv_heads, max_length, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
    )


def write_new_entries(cache: KVCache, new_k: jax.Array, new_v: jax.Array, layer_start: int = 0) -> KVCache:
    """Writes T new entries per row at [lengths[b], lengths[b] + T) for a contiguous range of layers.

    Args:
        new_k, new_v: [Lr, B, Hkv, T, D] for layers [layer_start, layer_start + Lr).
    Returns the cache with the entries written and `lengths` unchanged.
    """

    def write_rows(buffer, new):  # buffer [L, B, Hkv, S, D], new [Lr, B, Hkv, T, D]
        def write_one_row(row_buffer, row_new, start):  # [L, Hkv, S, D], [Lr, Hkv, T, D]
            new = row_new.astype(row_buffer.dtype)
            return jax.lax.dynamic_update_slice(row_buffer, new, (layer_start, 0, start, 0))

        return jax.vmap(write_one_row, in_axes=(1, 1, 0), out_axes=1)(buffer, new, cache.lengths)

    return dataclasses.replace(cache, k=write_rows(cache.k, new_k), v=write_rows(cache.v, new_v))


def commit_positions(cache: KVCache, source_offsets: jax.Array, num_accepted: jax.Array) -> KVCache:
    """Moves accepted entries into place and advances each row's length.

    After a verification forward wrote T entries at [len, len + T), entry `source_offsets[b, i]` (an index
    in [0, T)) becomes committed slot len + i for i < num_accepted[b].

    Args:
        source_offsets: int32[B, A], the accepted path's node indices in order (A <= T; padded arbitrarily).
        num_accepted: int32[B], how many of them to keep.
    """
    def gather_row(row_buffer, offsets, start):  # [L, Hkv, S, D], [A], scalar
        src = jnp.take(row_buffer, start + offsets, axis=2)  # [L, Hkv, A, D]
        return jax.lax.dynamic_update_slice(row_buffer, src, (0, 0, start, 0))

    def move(buffer):
        return jax.vmap(gather_row, in_axes=(1, 0, 0), out_axes=1)(buffer, source_offsets, cache.lengths)

    return KVCache(k=move(cache.k), v=move(cache.v), lengths=cache.lengths + num_accepted.astype(jnp.int32))
