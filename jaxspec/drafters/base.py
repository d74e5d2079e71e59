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
import numpy as np

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import ForwardOutput, Weights, execution_weights
from jaxspec.sampling import SamplingConfig, process_logits, sample_categorical
from jaxspec.tree import DraftTree
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
    """Base class. Subclasses define `num_nodes` (T, static) and override `propose` (and `init` / `update`)."""

    # hidden layers of the target the drafter wants from the prefill and verification forwards
    target_layers: tuple[int, ...] = ()
    name: str = "drafter"

    @property
    def num_nodes(self) -> int:
        """T, the drafted nodes per round (static)."""
        raise NotImplementedError

    @property
    def chain(self) -> bool:
        """True when every round's tree is a chain (node j's parent is node j - 1, static): the accepted path is then
        the root and nodes 0, 1, ... in order, which the verification forward already wrote where they are
        committed, so the commit only advances the lengths. A single node is always a chain."""
        return self.num_nodes == 1

    def execution_params(self, params: Any, mesh=None) -> Any:
        """The drafter's parameters as the generation loop runs them on this backend (`jaxspec.model.runs_per_layer`:
        a draft model's layers per layer, as the target's (`execution_weights`); an EAGLE head feature-major)."""
        return execution_weights(params, mesh) if isinstance(params, Weights) else params

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

    def draft_cost_layers(self, target_cfg: ModelConfig) -> float:
        """Drafting work per round in target-layer equivalents (Ls * m of METHODS.md's theoretical speedup
        tau * L / (Ls * m + L)); 0 for drafters whose work is negligible (prompt lookup, Medusa's heads)."""
        return 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainDrafter(Drafter):
    """A drafter that runs a causal LM `depth` times per round: a chain, or with tree_width W > 1 the top-W
    siblings at every depth (see `draft_chain`)."""

    depth: int
    tree_width: int = 1

    @property
    def num_nodes(self) -> int:
        return self.depth * self.tree_width

    @property
    def chain(self) -> bool:
        return self.tree_width == 1


def choose_draft(logits: jax.Array, sampling: SamplingConfig, rng, width: int = 1
                 ) -> tuple[jax.Array, jax.Array | None]:
    """One drafting step: logits [B, V] over target ids -> (drafts int32[B, W], q [B, V] or None).

    W = 1: greedy takes the argmax (q a point mass, None); sampling draws from q, the drafter's distribution under
    the same temperature / top-k / top-p, kept for the rejection rule. W > 1: the W most likely tokens of q,
    deterministic siblings (point masses), at every temperature. Shared by every chain drafter and the pipelines."""
    logq = process_logits(logits, sampling)  # [B, V]
    if width > 1:
        return jax.lax.top_k(logq, width)[1].astype(jnp.int32), None
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], None
    return sample_categorical(rng, logq)[:, None], jnp.exp(logq)


def draft_chain(step, first_logits: jax.Array, first_position: jax.Array, depth: int, sampling: SamplingConfig,
                rng: jax.Array, carry: Any, width: int = 1) -> tuple[DraftTree, Any]:
    """Drafts a chain of `depth` tokens autoregressively from a causal LM, optionally with side branches.

    width 1: a chain. Greedy: argmax drafts (q = point mass, no probabilities kept); otherwise each token is sampled
    from q, the drafter's distribution under the same temperature / top-k / top-p, and q is kept.
    width W > 1: at every depth the W most likely tokens of q become siblings (deterministic top-k children, so q is
    a point mass and the acceptance rule stays exact at any temperature) and the most likely one carries the chain
    on. T = depth * W nodes for the same `depth` drafter forwards; node i * W + r is the rank-r token at depth i.

    Args:
        step: (token int32[B], position int32[B], carry) -> (logits [B, V], carry): feeds one token.
        first_logits: [B, V], the drafter's logits at the root. first_position: int32[B], the root's position.
    Returns the tree and the final carry.
    """
    batch = first_logits.shape[0]

    def choose(logits, key):  # -> (tokens int32[B, W], q [B, V] or None)
        return choose_draft(logits, sampling, key, width)

    keys = jax.random.split(rng, depth)
    tokens, q = choose(first_logits, keys[0])

    def body(state, i):
        tokens, carry = state
        logits, carry = step(tokens[:, 0], first_position + i + 1, carry)
        new, q = choose(logits, keys[i + 1])
        return (new, carry), (new, q)

    (_, carry), (rest, rest_q) = jax.lax.scan(body, (tokens, carry), jnp.arange(depth - 1))
    # rest: [depth-1, B, W] -> nodes ordered by depth, then rank
    all_tokens = jnp.concatenate([tokens[:, None], rest.transpose(1, 0, 2)], axis=1).reshape(batch, depth * width)
    draft_probs = None if q is None else jnp.concatenate([q[:, None], rest_q.transpose(1, 0, 2)], axis=1)
    parents = np.repeat(np.arange(-1, depth - 1) * width, width).clip(min=-1).astype(np.int32)  # chain node above
    return DraftTree(tokens=all_tokens, parents=jnp.broadcast_to(jnp.asarray(parents), (batch, depth * width)),
                     valid=jnp.ones((batch, depth * width), jnp.bool_), draft_probs=draft_probs), carry
