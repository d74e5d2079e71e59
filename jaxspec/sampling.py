"""The target distribution p: temperature, top-k and top-p applied to logits, and sampling from it.

Every decoding path (autoregressive and speculative verification) takes p from `target_probs` /
`process_logits`, so "the distribution after the user's temperature / top-k / top-p" means the same thing
everywhere. Temperature 0 means greedy: p is a point mass on the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are chosen (static: one compilation per setting). temperature 0 = greedy.

    top_k 0 and top_p 1.0 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingConfig()


def process_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits: float[..., V] -> float32 log-probabilities [..., V] of p (-inf outside the kept set).

    For greedy sampling the result is a point mass on the argmax (log 1 there, -inf elsewhere).
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        top = jnp.argmax(logits, axis=-1)
        return jnp.where(jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.bool_), 0.0, -jnp.inf)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p: a token is kept if the mass before it is < top_p
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        kept = mass_before < sampling.top_p
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def target_probs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits: [..., V] -> float32 probabilities [..., V] of p."""
    return jnp.exp(process_logits(logits, sampling))


def sample_token(rng: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits: [B, V] -> int32[B], argmax when greedy, else a draw from p."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, process_logits(logits, sampling), axis=-1).astype(jnp.int32)
