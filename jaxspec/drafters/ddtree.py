"""DDTree: a best-first tree from the DFlash block head's per-depth marginals under a node budget.

The same block forward as DFlash (`jaxspec.drafters.block_head`); the tree is the best-first expansion of the
product of the marginals: up to W children per node, B nodes (`best_first_tree`: a heap with static shapes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters.block_head import BlockHeadDrafter
from jaxspec.drafters.eagle import draft_to_target
from jaxspec.tree import DraftTree


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
    top_lp, top_ids = jax.lax.top_k(log_probs, width)  # [B, D, W]
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDTreeDrafter(BlockHeadDrafter):
    """The best-first tree of `budget` nodes with up to `tree_width` children per node."""

    tree_width: int = 4
    name: str = "ddtree"

    def draft(self, params, log_probs, context, root_feature, inputs, target_cfg, sampling, rng) -> DraftTree:
        with jax.named_scope("best_first_tree"):
            ids, parents, valid, _ = best_first_tree(log_probs, self.budget, self.tree_width)
        ids, parents, valid = self.improve(params, context, root_feature, inputs, target_cfg, ids, parents, valid)
        return DraftTree(tokens=draft_to_target(params.head)[ids], parents=parents, valid=valid)

    def improve(self, params, context, root_feature, inputs, target_cfg, ids, parents, valid):
        """The tree after any further head forwards (none here; JetSpec re-scores it)."""
        return ids, parents, valid
