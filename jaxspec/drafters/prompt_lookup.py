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
import numpy as np

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


def lookup_chain(history: jax.Array, lengths: jax.Array, depth: int, max_ngram: int = 3,
                 min_ngram: int = 1) -> tuple[jax.Array, jax.Array]:
    """The prompt-lookup chain of every row: for n from `max_ngram` down to `min_ngram`, the tokens that followed the
    latest earlier occurrence of the row's last n tokens (the longest n with a match wins).

    Args:
        history: int32[B, S] each row's context in [0, lengths] (the root at `lengths`); lengths: int32[B].
        depth: K, the chain's length.
    Returns:
        (tokens int32[B, K], valid bool[B, K]): valid is False past the context's end and, once a node is invalid,
        for every node after it (a chain); all False without a match.
    """
    def one_row(row, length):
        found = jnp.bool_(False)
        tokens = jnp.zeros((depth,), jnp.int32)  # [K]
        valid = jnp.zeros((depth,), jnp.bool_)  # [K]
        for n in range(max_ngram, min_ngram - 1, -1):  # longest n-gram first
            f, t, v = find_continuation(row, length, n, depth)
            use = f & ~found
            tokens, valid, found = jnp.where(use, t, tokens), jnp.where(use, v, valid), found | f
        return tokens, valid

    tokens, valid = jax.vmap(one_row)(history, lengths)  # [B, K] each
    return tokens, jnp.cumprod(valid, axis=1).astype(jnp.bool_)


def lookup_statistics(tokens: np.ndarray, lengths: np.ndarray, response_starts: np.ndarray, depth: int,
                      max_ngram: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """What the prompt-lookup chain gives at T=0 at every round root along text the target generated (the positions
    and order of `jaxspec.drafters.eagle.draft_ranks`): how many of its tokens the target would accept, and how many
    of them are valid (the others are past the chain's end: no match, or the context ends there).

    At column t (the round's root is token t + 1, everything up to it committed) the chain of `lookup_chain` is
    drafted from the text up to the root, and its run is the number of its leading tokens equal to tokens t + 2, ...

    Args:
        tokens: int[R, S] prompts followed by the target's greedy continuations, right-padded; lengths: int[R];
        response_starts: int[R] index of each row's first generated token; depth: the longest chain measured.
    Returns:
        (runs, valid), int64[P] each in [0, depth], one per measured position (those of `draft_ranks`); a shorter
        chain of k tokens has run min(run, k) and min(valid, k) valid tokens.
    """
    toks = np.asarray(tokens, np.int64)  # [R, S]
    r, s = toks.shape
    runs, valids = [], []
    for row in range(r):
        cols = np.arange(max(int(response_starts[row]) - 1, 0), max(int(lengths[row]) - 2, 0))  # [P_row]
        if len(cols) == 0:
            continue
        history = jnp.broadcast_to(jnp.asarray(toks[row], jnp.int32), (len(cols), s))  # [P_row, S]
        chain, valid = lookup_chain(history, jnp.asarray(cols + 1, jnp.int32), depth, max_ngram)  # [P_row, K]
        wanted_at = cols[:, None] + 2 + np.arange(depth)[None, :]  # [P_row, K]
        wanted = np.where(wanted_at < lengths[row], toks[row, np.minimum(wanted_at, s - 1)], -1)  # [P_row, K]
        hit = np.asarray(valid) & (np.asarray(chain) == wanted)  # [P_row, K]
        runs.append(np.cumprod(hit, axis=1).sum(axis=1))
        valids.append(np.asarray(valid).sum(axis=1))
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(runs).astype(np.int64), np.concatenate(valids).astype(np.int64)


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

    @property
    def chain(self) -> bool:
        return True

    def propose(self, params, state, inputs: RoundInputs, target_cfg, sampling, rng):
        tokens, valid = lookup_chain(inputs.history, inputs.lengths, self.depth, self.max_ngram, self.min_ngram)
        parents = jnp.broadcast_to(jnp.asarray(chain_parents(self.num_nodes)), tokens.shape)
        return DraftTree(tokens=tokens, parents=parents, valid=valid), state, inputs.target_cache
