"""Draft trees with static shapes: T drafted nodes per row, a parent array, and what verification needs.

Node numbering: the drafted nodes are 0..T-1; parent -1 is the root, which is the last committed-but-not-cached
token (the previous round's bonus token). Verification feeds T + 1 tokens, the root first, so node j sits at
verification index j + 1. Parents always come before their children (parents[j] < j) and siblings are tried in
index order. A chain of K is the tree with parents [-1, 0, 1, ..., K-2]. Fixed topologies (chains, Medusa-style
"choices") and dynamic ones (EAGLE-2, DDTree, JetSpec) are the same type: only the parent values differ.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftTree:
    """A batch of draft trees.

    tokens: int32[B, T] drafted tokens; parents: int32[B, T] in [-1, j) for node j; valid: bool[B, T], False for
    padding nodes that must never be accepted (a drafter with fewer candidates than T); draft_probs: float32[B, T, V]
    or None: the distribution q that node j's token was sampled from (given its parent). None means the tokens were
    chosen deterministically (top-k, n-gram copy, argmax): q is then the point mass on the node's token, which the
    acceptance rule handles as accept-with-p(x) and remove-x-on-rejection.
    """

    tokens: jax.Array  # int32[B, T]
    parents: jax.Array  # int32[B, T]
    valid: jax.Array  # bool[B, T]
    draft_probs: jax.Array | None = None  # float32[B, T, V]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def chain_parents(num_nodes: int) -> np.ndarray:
    """int32[K]: the parents of a chain, [-1, 0, 1, ..., K-2]."""
    return np.arange(-1, num_nodes - 1, dtype=np.int32)


def choices_parents(choices: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """A fixed tree from Medusa-style "choices": each choice is a path of child ranks from the root.

    Example: [(0,), (1,), (0, 0), (0, 1)] is root -> {top-1, top-2}, top-1 -> {its top-1, its top-2}.
    Returns (parents int32[T], ranks int32[T]) with nodes sorted by depth, then by path, so parents come first.
    """
    paths = sorted(set(tuple(c) for c in choices), key=lambda c: (len(c), c))
    index = {path: i for i, path in enumerate(paths)}
    parents, ranks = [], []
    for path in paths:
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"Tree choice {path} has no parent {path[:-1]} among the choices.")
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
        ranks.append(path[-1])
    return np.array(parents, np.int32), np.array(ranks, np.int32)


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """bool[B, T+1, T+1] over verification indices (root = 0, node j = j + 1): mask[b, i, k] is True when k is i
    itself or one of its ancestors. This is the attention mask of tree verification.

    parents: int32[B, T].
    """
    b, t = parents.shape
    # Pointer doubling: after step k, mask[i] holds i's ancestors less than 2^k generations up (and i) and jump[i]
    # the ancestor exactly 2^k up (the root is its own parent, a fixed point). Depth is at most T, so
    # ceil(log2(T + 1)) = T.bit_length() steps cover every ancestor: 7 for a 64-node tree instead of 64.
    jump = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parents + 1], axis=1)  # [B, T+1], the parent first
    mask = jnp.eye(t + 1, dtype=jnp.bool_)[None].repeat(b, 0)  # [B, T+1, T+1]
    for _ in range(t.bit_length()):
        mask = mask | jnp.take_along_axis(mask, jump[:, :, None], axis=1)  # [B, T+1, T+1]
        jump = jnp.take_along_axis(jump, jump, axis=1)  # [B, T+1]
    return mask


def node_depths(parents: jax.Array) -> jax.Array:
    """int32[B, T+1]: depth of every verification index (root 0, its children 1, ...)."""
    return jnp.sum(ancestor_mask(parents), axis=-1).astype(jnp.int32) - 1


def tree_positions(parents: jax.Array, root_position: jax.Array) -> jax.Array:
    """int32[B, T+1]: RoPE positions of the verification tokens, root_position[b] + depth."""
    return root_position[:, None] + node_depths(parents)
