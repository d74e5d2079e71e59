"""Prompt lookup (n-gram) drafting: training-free, copies what followed the last n-gram's most recent earlier
occurrence in the context (prompt and generated text). Hugging Face's `prompt_lookup_num_tokens`, vLLM's ngram.

For n from `max_ngram` down to `min_ngram`, the most recent earlier match of the context's last n tokens wins
and its K following tokens are the chain. Without a match the chain is marked invalid (nothing is accepted and
the round still yields the target's own token). Drafts are deterministic, so q is a point mass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Drafter, RoundInputs
from jaxspec.tree import DraftTree, chain_parents


def find_continuation(history: jax.Array, length: jax.Array, ngram: int, num_tokens: int):
    """One row. history: int32[S] with the context in [0, length] (the root at `length`).

    Returns (found bool, tokens int32[K], valid bool[K]): what followed the latest earlier occurrence of the
    last `ngram` tokens, cut where the context ends.
    """
    s = history.shape[0]
    end = length + 1  # context is history[:end]
    tail = jax.lax.dynamic_slice(history, (jnp.maximum(end - ngram, 0),), (ngram,))  # [n]
    starts = jnp.arange(s)  # candidate match starts
    windows = jnp.stack([jnp.roll(history, -i) for i in range(ngram)], axis=1)  # [S, n]: history[s + i]
    matches = jnp.all(windows == tail[None, :], axis=1) & (starts + ngram < end) & (end >= ngram)
    best = jnp.max(jnp.where(matches, starts, -1))
    follow = best + ngram + jnp.arange(num_tokens)  # [K]
    tokens = jnp.take(history, jnp.clip(follow, 0, s - 1))
    valid = (best >= 0) & (follow < end)
    return best >= 0, tokens, valid


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookupDrafter(Drafter):
    """params: None; state: None."""

    depth: int
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "prompt-lookup"

    @property
    def num_nodes(self) -> int:
        return self.depth

    def propose(self, params, state, inputs: RoundInputs, target_cfg, sampling, rng):
        def one_row(history, length):
            found = jnp.bool_(False)
            tokens = jnp.zeros((self.num_nodes,), jnp.int32)
            valid = jnp.zeros((self.num_nodes,), jnp.bool_)
            for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest n-gram first
                f, t, v = find_continuation(history, length, n, self.num_nodes)
                use = f & ~found
                tokens, valid, found = jnp.where(use, t, tokens), jnp.where(use, v, valid), found | f
            return tokens, valid

        tokens, valid = jax.vmap(one_row)(inputs.history, inputs.lengths)
        valid = jnp.cumprod(valid, axis=1).astype(jnp.bool_)  # a chain: nothing after an invalid node
        parents = jnp.broadcast_to(jnp.asarray(chain_parents(self.num_nodes)), tokens.shape)
        return DraftTree(tokens=tokens, parents=parents, valid=valid), state, inputs.target_cache
