"""JetSpec: a tree-causal block head, its best-first tree re-scored by path-conditioned forwards.

Wave 0: the tree-causal block forward on the all-mask chain (plain causal attention there) gives per-depth
marginals and DDTree's best-first tree (`jaxspec.tree.best_first_tree`). Then `refresh_steps` R more
forwards re-score the tree (`refresh_tree`): one tree-causal forward over the root and all B nodes, each node fed its
own token, so each node's output is the distribution of its children given its whole path; the candidates are the
top-W children of every node, scored by the cumulative path-conditional log-probability, and the best B (an
ancestor-closed set) are the next tree. R = 0 is the pure "one forward" tree. Decision and cost: docs/jetspec.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters.block_head import ParallelHeadParams, block_forward, tree_block_mask
from jaxspec.drafters.ddtree import DDTreeDrafter
from jaxspec.drafters.eagle import draft_to_target
from jaxspec.tree import select_nodes


def refresh_tree(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, context: KVCache,
                 root_feature: jax.Array, root: jax.Array, ids: jax.Array, parents: jax.Array, valid: jax.Array,
                 width: int):
    """JetSpec's path-conditioned re-scoring: one tree-causal forward over the root and the B nodes of a tree.

    Each node is fed its own token, so its output is the distribution of its children given its exact path. The
    candidates are the top-W children of the root and of every node whose own token is among its parent's new
    top W; a candidate scores the sum of the new log-probs along its path. The best B candidates (ancestor-closed:
    a child never outscores its parent, which has the lower index) are the new tree, one depth deeper at most.

    Args:
        context: the head's cache (lengths = L-1); root_feature: [B, d]; root: int32[B];
        ids / parents / valid: the tree, [B, T] each (draft ids; parents -1 = root, before their children).
    Returns:
        (ids, parents, valid, scores) of the new tree, [B, T] each.
    """
    b, t = ids.shape
    d2t = draft_to_target(params.head)  # [Vd]
    tokens = jnp.concatenate([root[:, None], d2t[ids]], axis=1)  # [B, T+1] target ids
    mask = tree_block_mask(parents)  # [B, T+1, T+1]
    positions = context.lengths[:, None] + jnp.sum(mask, axis=-1).astype(jnp.int32) - 1  # [B, T+1]: L-1 + depth
    logits = block_forward(params, cfg, embed, context, root_feature, tokens, jnp.ones((b, t + 1), jnp.bool_),
                           positions, mask)
    log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, T+1, Vd]
    cand_lp, cand_ids = jax.lax.top_k(log_probs, width)  # [B, T+1, W]
    parent_slot = parents + 1  # [B, T] the slot (0 = root) whose output scored each node
    parent_cands = jnp.take_along_axis(cand_ids, parent_slot[:, :, None], axis=1)  # [B, T, W]
    hit = parent_cands == ids[:, :, None]  # [B, T, W]
    in_top = valid & jnp.any(hit, axis=-1)  # [B, T]
    own_lp = jnp.take_along_axis(jnp.take_along_axis(log_probs, parent_slot[:, :, None], axis=1),
                                 ids[:, :, None], axis=2)[..., 0]  # [B, T]
    path = mask[:, 1:, 1:]  # [B, T, T]: node m is node n or one of its ancestors
    ok = ~jnp.any(path & ~in_top[:, None, :], axis=-1)  # [B, T]
    node_score = jnp.where(ok, jnp.sum(jnp.where(path, own_lp[:, None, :], 0.0), axis=-1), -jnp.inf)  # [B, T]
    base = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), node_score], axis=1)  # [B, T+1] per slot
    scores = (base[:, :, None] + cand_lp).reshape(b, (t + 1) * width)  # [B, (T+1) W]
    # the candidate standing for node n (its parent's rank-w child) hosts the candidates of node n's slot
    node_cand = parent_slot * width + jnp.argmax(hit, axis=-1).astype(jnp.int32)  # [B, T]
    host = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), node_cand], axis=1)  # [B, T+1]
    cand_parents = jnp.repeat(host, width, axis=1)  # [B, (T+1) W]
    keep, new_parents = select_nodes(scores, cand_parents, t)  # [B, T] each
    new_scores = jnp.take_along_axis(scores, keep, axis=1)
    new_ids = jnp.take_along_axis(cand_ids.reshape(b, -1), keep, axis=1)
    return new_ids, new_parents, new_scores > -jnp.inf, new_scores


@dataclasses.dataclass(frozen=True, kw_only=True)
class JetSpecDrafter(DDTreeDrafter):
    """DDTree's best-first tree from the tree-causal head, then `refresh_steps` path-conditioned re-scorings."""

    refresh_steps: int = 1
    name: str = "jetspec"

    attention = "tree_causal"

    @property
    def depth(self) -> int:
        """The block plus one depth per refresh."""
        return self.block_size + self.refresh_steps

    def improve(self, params, context, root_feature, inputs, target_cfg, ids, parents, valid):
        for _ in range(self.refresh_steps):
            with jax.named_scope("refresh_tree"):
                ids, parents, valid, _ = refresh_tree(params, target_cfg, inputs.target_weights.embed, context,
                                                      root_feature, inputs.root, ids, parents, valid, self.tree_width)
        return ids, parents, valid

    def draft_cost_layers(self, target_cfg):
        # the block forward plus the refresh forwards, one decoder layer each
        return float(1 + self.refresh_steps)
