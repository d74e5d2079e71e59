"""The drafter interface every method plugs into, and the pieces several drafters share.

A drafter is a frozen, hashable dataclass holding only static settings (it is a static argument of the jitted
decoding loop); its learned parameters (`params`, any pytree, None for training-free drafters) and its running
state (its own caches, features, ...) are pytrees the loop threads through. Per round the loop calls

    tree, state, target_cache = drafter.propose(params, state, round_inputs, rng)
    ... one target forward over the tree, acceptance, commit ...
    state = drafter.update(params, state, round_inputs, verification, acceptance)

`init` runs once after the target's prefill. A drafter may write the target cache beyond its committed length
(early exit reuses the target's own shallow layers); verification overwrites those slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import ForwardOutput, Weights
from jaxspec.sampling import SamplingConfig, process_logits
from jaxspec.tree import DraftTree, chain_parents
from jaxspec.verification import Acceptance


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundInputs:
    """What a drafter may look at. history: int32[B, S] every committed token and the root at index lengths[b];
    lengths: int32[B], the target's committed length (= the root's position); root: int32[B]."""

    target_weights: Weights
    target_cache: KVCache
    history: jax.Array  # int32[B, S]
    lengths: jax.Array  # int32[B]
    root: jax.Array  # int32[B]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drafter:
    """Base class. Subclasses set `num_nodes` (T, static) and override `propose` (and `init` / `update`)."""

    num_nodes: int
    # hidden layers of the target the drafter wants from the prefill and verification forwards
    target_layers: tuple[int, ...] = ()
    name: str = "drafter"

    def init(self, params: Any, target_cfg: ModelConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
             prefill_out: ForwardOutput, cache_size: int, sampling: SamplingConfig) -> Any:
        """State after the target's prefill. prompt_tokens: int32[B, P]; prompt_lengths: int32[B]."""
        return None

    def propose(self, params: Any, state: Any, inputs: RoundInputs, target_cfg: ModelConfig,
                sampling: SamplingConfig, rng: jax.Array) -> tuple[DraftTree, Any, KVCache]:
        raise NotImplementedError

    def update(self, params: Any, state: Any, inputs: RoundInputs, verification: ForwardOutput,
               acceptance: Acceptance) -> Any:
        """State after a round; `acceptance.path` indexes `verification` (root = 0)."""
        return state

    def check_compatible(self, params: Any, target_cfg: ModelConfig, target_tokenizer: Any = None) -> None:
        """Raises UserError when this drafter cannot serve this target (another vocabulary, another model)."""


def draft_chain(step, first_logits: jax.Array, first_position: jax.Array, num_tokens: int,
                sampling: SamplingConfig, rng: jax.Array, carry: Any) -> tuple[DraftTree, Any]:
    """Drafts a chain of `num_tokens` tokens autoregressively from a causal LM.

    Args:
        step: (token int32[B], position int32[B], carry) -> (logits [B, V], carry): feeds one token.
        first_logits: [B, V], the drafter's logits at the root. first_position: int32[B], the root's position.
        sampling: greedy -> argmax drafts (q = point mass, no probabilities kept); otherwise tokens are sampled
            from q = the drafter's distribution under the same temperature / top-k / top-p, and q is kept.
    Returns the chain as a DraftTree and the final carry.
    """
    batch = first_logits.shape[0]

    def choose(logits, key):
        if sampling.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        logq = process_logits(logits, sampling)  # [B, V]
        return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), jnp.exp(logq)

    keys = jax.random.split(rng, num_tokens)
    token, q = choose(first_logits, keys[0])

    def body(state, i):
        token, carry = state
        logits, carry = step(token, first_position + i + 1, carry)
        new, q = choose(logits, keys[i + 1])
        return (new, carry), (new, q)

    (_, carry), (rest, rest_q) = jax.lax.scan(body, (token, carry), jnp.arange(num_tokens - 1))
    tokens = jnp.concatenate([token[:, None], rest.T], axis=1)  # [B, K]
    draft_probs = None if q is None else jnp.concatenate([q[:, None], rest_q.transpose(1, 0, 2)], axis=1)
    parents = jnp.broadcast_to(jnp.asarray(chain_parents(num_tokens)), (batch, num_tokens))
    return DraftTree(tokens=tokens, parents=parents, valid=jnp.ones((batch, num_tokens), jnp.bool_),
                     draft_probs=draft_probs), carry
