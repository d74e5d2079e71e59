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


def merge_chain(tree: DraftTree, tokens: jax.Array, valid: jax.Array, spares: jax.Array | None = None) -> DraftTree:
    """A tree with a chain of other candidates merged in as a trie (EAGLE with prompt-lookup candidates).

    The chain's nodes follow the tree's (T + K nodes, parents still before children). Its first token hangs under
    the root and each next one under the previous; while a chain token equals a valid tree node under the same
    parent, that node stands for it (the chain node is marked invalid: never accepted, no duplicate sibling) and the
    chain goes on under it. So at T=0 the accepted path is the longer of the tree's and the chain's.

    The slots past the chain's valid end (no match, or the context ends) would be verified for nothing: with
    `spares`, more children of the root fill them in order (an EAGLE head's next-ranked first tokens), a spare equal
    to the chain's kept first token left invalid. Slots of chain tokens the tree already holds are not refilled.

    Args:
        tree: the drafter's tree, T nodes; tokens: int32[B, K] the chain; valid: bool[B, K] (False from its end on);
        spares: int32[B, K] or None: root children for the slots past the chain's end.
    Returns:
        DraftTree with T + K nodes, draft_probs None (every candidate chosen deterministically).
    """
    if tree.draft_probs is not None:
        raise ValueError("merge_chain needs a tree of deterministic candidates (draft_probs None).")
    b, t = tree.tokens.shape
    attach = jnp.full((b,), -1, jnp.int32)  # [B]: where chain node i hangs (a tree node, a chain node or the root)
    parents, keep = [], []
    for i in range(tokens.shape[1]):
        same = (tree.parents == attach[:, None]) & (tree.tokens == tokens[:, i: i + 1]) & tree.valid  # [B, T]
        found = jnp.any(same, axis=1) & valid[:, i]  # [B]: the tree holds this token at this place already
        parents.append(attach)
        keep.append(valid[:, i] & ~found)
        attach = jnp.where(found, jnp.argmax(same, axis=1).astype(jnp.int32), jnp.int32(t + i))
    chain_tokens = tokens.astype(tree.tokens.dtype)  # [B, K]
    chain_parents, chain_keep = jnp.stack(parents, axis=1), jnp.stack(keep, axis=1)  # [B, K] each
    if spares is not None:
        past_end = ~valid  # [B, K]: a suffix (valid is a chain's)
        spare = jnp.take_along_axis(spares.astype(chain_tokens.dtype),
                                    jnp.maximum(jnp.cumsum(past_end, axis=1) - 1, 0), axis=1)  # [B, K], in order
        # [B, K]: no duplicate of the chain's first token where it is kept (a root child: it hangs under the root)
        spare_ok = ~(chain_keep[:, :1] & (spare == chain_tokens[:, :1]))
        chain_tokens = jnp.where(past_end, spare, chain_tokens)
        chain_parents = jnp.where(past_end, -1, chain_parents)
        chain_keep = jnp.where(past_end, spare_ok, chain_keep)
    return DraftTree(tokens=jnp.concatenate([tree.tokens, chain_tokens], axis=1),
                     parents=jnp.concatenate([tree.parents, chain_parents], axis=1),
                     valid=jnp.concatenate([tree.valid, chain_keep], axis=1))


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


# ---------------------------------------------------------------------------------------------- tree selection
# The tree-shaping steps that depend on scores only, shared by the drafters that grow trees from their heads:
# EAGLE-2/3 and JetSpec keep the best nodes of a scored pool (`select_nodes`); DDTree and JetSpec grow a best-first
# tree from per-depth marginals (`best_first_tree`).


def select_nodes(pool_scores: jax.Array, pool_parents: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """The best `num_nodes` pool nodes by score, ties to the lower pool index, in pool order.

    When every child scores at most its parent and parents have lower pool indices, the kept set is
    ancestor-closed and pool order puts parents before children.

    Args:
        pool_scores: float32[B, M]; pool_parents: int32[B, M], the parent's pool index (-1 = root).
    Returns:
        (keep int32[B, N]: pool indices, ascending; parents int32[B, N]: indices into `keep`, -1 = root).
    """
    m = pool_scores.shape[1]
    best = jnp.argsort(-pool_scores, axis=-1, stable=True)[:, :num_nodes]  # [B, N]
    keep = jnp.sort(best, axis=-1).astype(jnp.int32)  # [B, N]
    slot_of = jax.vmap(lambda k: jnp.full((m,), -1, jnp.int32).at[k].set(jnp.arange(num_nodes, dtype=jnp.int32)))(
        keep)  # [B, M]: position in `keep` of each pool node, -1 if dropped
    parent = jnp.take_along_axis(pool_parents, keep, axis=1)  # [B, N]
    parents = jnp.where(parent < 0, -1, jnp.take_along_axis(slot_of, jnp.maximum(parent, 0), axis=1))
    return keep, parents


def best_first_tree(log_probs: jax.Array, budget: int, width: int):
    """Best-first tree on the product of per-depth marginals under a node budget (DDTree, JetSpec wave 0).

    A heap of candidates keyed by cumulative log-probability: pop the best candidate, it becomes the next node, and
    its up-to-W children (the W most likely tokens at the next depth) become candidates; stop after `budget` pops.
    Static shapes: candidate slot w holds the root's rank-w child, slot W (i + 1) + w node i's rank-w child; a pop is
    an argmax over the slots (ties to the lowest slot).

    Args:
        log_probs: float32[B, D, Vd] log marginals, depth d + 1 at index d.
    Returns:
        (ids int32[B, budget] draft ids, parents int32[B, budget] (-1 = root, parents[j] < j), valid bool[B, budget]
        (False when the candidates ran out), scores float32[B, budget] cumulative log-probs), nodes in pop order.
    """
    depth_count = log_probs.shape[1]
    # behind a barrier: read by the pops' dynamic indexing, XLA:CPU otherwise ran this top-k as a full stable sort of
    # the vocabulary (12 ms for [1, 8, 8192], 100x its top-k kernel; docs/cpu-performance.md, eighth pass)
    top_lp, top_ids = jax.lax.optimization_barrier(jax.lax.top_k(log_probs, width))  # [B, D, W]
    slots = (budget + 1) * width

    def one_row(top_lp, top_ids):  # [D, W] each
        state = dict(
            score=jnp.full((slots,), -jnp.inf, jnp.float32).at[:width].set(top_lp[0]),  # [M] -inf: empty or popped
            parent=jnp.full((slots,), -1, jnp.int32),  # [M] node index of the candidate's parent
            depth=jnp.zeros((slots,), jnp.int32).at[:width].set(1),  # [M]
            rank=jnp.tile(jnp.arange(width, dtype=jnp.int32), budget + 1),  # [M]
            ids=jnp.zeros((budget,), jnp.int32), parents=jnp.full((budget,), -1, jnp.int32),
            valid=jnp.zeros((budget,), jnp.bool_), scores=jnp.full((budget,), -jnp.inf, jnp.float32),
        )

        def pop(i, s):
            best = jnp.argmax(s["score"])
            score, depth = s["score"][best], s["depth"][best]
            ok = score > -jnp.inf
            child_lp = jnp.where(ok & (depth < depth_count), top_lp[jnp.minimum(depth, depth_count - 1)], -jnp.inf)
            start = width * (i + 1)
            return dict(
                score=jax.lax.dynamic_update_slice(s["score"].at[best].set(-jnp.inf), score + child_lp, (start,)),
                parent=jax.lax.dynamic_update_slice(s["parent"], jnp.full((width,), i, jnp.int32), (start,)),
                depth=jax.lax.dynamic_update_slice(s["depth"], jnp.full((width,), depth + 1, jnp.int32), (start,)),
                rank=s["rank"],
                ids=s["ids"].at[i].set(top_ids[depth - 1, s["rank"][best]]),
                parents=s["parents"].at[i].set(jnp.where(ok, s["parent"][best], -1)),
                valid=s["valid"].at[i].set(ok), scores=s["scores"].at[i].set(score),
            )

        s = jax.lax.fori_loop(0, budget, pop, state)
        return s["ids"], s["parents"], s["valid"], s["scores"]

    return jax.vmap(one_row)(top_lp, top_ids)
