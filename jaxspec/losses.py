"""Distillation losses for drafters: forward KL (default), reverse KL, SFT; position weights; masks.

Every loss takes the drafter's logits and the frozen target's logits (or tokens) over the same positions, a
mask of positions that count (response tokens, not prompt or padding) and optional per-position weights, and
returns the weighted mean over counted positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_KINDS = ("forward_kl", "reverse_kl", "sft")


def forward_kl(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """KL(p || q) per position: sum_v p log(p / q), p = softmax(target), q = softmax(draft). [..., V] -> [...]."""
    logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def reverse_kl(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """KL(q || p) per position: mode-seeking. [..., V] -> [...]."""
    return forward_kl(target_logits, draft_logits)


def cross_entropy(draft_logits: jax.Array, labels: jax.Array) -> jax.Array:
    """-log q(label) per position. draft_logits [..., V], labels int32[...] -> [...]."""
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]


def per_position_loss(kind: str, draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """The loss of `kind` per position; SFT uses the target's argmax token as the label (the target's own text,
    since regenerated data is the target's greedy output)."""
    if kind == "forward_kl":
        return forward_kl(draft_logits, target_logits)
    if kind == "reverse_kl":
        return reverse_kl(draft_logits, target_logits)
    if kind == "sft":
        return cross_entropy(draft_logits, jnp.argmax(target_logits, axis=-1))
    raise ValueError(f"Unknown loss '{kind}'; choose one of {', '.join(LOSS_KINDS)}.")


def masked_mean(values: jax.Array, mask: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """sum(w * m * values) / sum(w * m). values, mask: [...]; weights broadcastable to them."""
    w = mask.astype(jnp.float32)
    if weights is not None:
        w = w * weights
    return jnp.sum(values * w) / jnp.maximum(jnp.sum(w), 1e-9)


def decay_weights(num_positions: int, decay: float) -> jax.Array:
    """float32[K]: decay^i for draft position i = 0..K-1 (Medusa's and EAGLE-3's 0.8^i)."""
    return decay ** jnp.arange(num_positions, dtype=jnp.float32)


def gamma_weights(num_positions: int, gamma: float) -> jax.Array:
    """float32[K]: exp(-gamma * i), the DFlash-style decay: gamma 0 weights all positions equally, a larger gamma
    weights early positions more."""
    return jnp.exp(-gamma * jnp.arange(num_positions, dtype=jnp.float32))
