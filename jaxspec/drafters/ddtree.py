"""DDTree: a best-first tree from the DFlash block head's per-depth marginals under a node budget.

The same block forward as DFlash (`jaxspec.drafters.block_head`); the tree is the best-first expansion of the
product of the marginals: up to W children per node, B nodes (`jaxspec.tree.best_first_tree`: a heap with static
shapes).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.drafters.block_head import BlockHeadDrafter
from jaxspec.drafters.eagle import draft_to_target
from jaxspec.tree import DraftTree, best_first_tree


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
