"""Self-drafting by early exit: the target's first k layers, then its final norm and LM head, draft a chain.

A training-free BASELINE for a target with no small sibling (SmolLM2-135M), not one of the seed methods: it is
the degenerate case of PPSD's shallow drafting with no pipeline and no trained head. It needs no cache of its
own: the target's cache already holds layers [0, k) of every committed token, and drafted tokens are written
into those layers beyond the committed length, where verification overwrites them.
"""

from __future__ import annotations

import dataclasses

from jaxspec.drafters.base import ChainDrafter, RoundInputs, draft_chain
from jaxspec.errors import UserError
from jaxspec.model import forward, lm_head


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyExitDrafter(ChainDrafter):
    """params: None (the target's own weights are used)."""

    exit_layer: int
    name: str = "early-exit"

    def check_compatible(self, params, target_cfg, target_tokenizer=None):
        if not 1 <= self.exit_layer < target_cfg.num_layers:
            raise UserError(
                f"--exit-layer must be between 1 and {target_cfg.num_layers - 1} for this target, "
                f"got {self.exit_layer}."
            )

    def draft_cost_layers(self, target_cfg):
        return float(self.exit_layer * self.depth)  # `depth` runs of the first exit_layer layers

    def propose(self, params, state, inputs: RoundInputs, target_cfg, sampling, rng):
        weights = inputs.target_weights

        def step(token, position, cache):  # token, position: [B]
            cache = dataclasses.replace(cache, lengths=position)
            out = forward(weights, target_cfg, token[:, None], position[:, None], cache,
                          layer_range=(0, self.exit_layer), compute_logits=False)
            logits = lm_head(weights, target_cfg, out.last_hidden)[:, 0]
            return logits, dataclasses.replace(out.cache, lengths=inputs.lengths)

        first, cache = step(inputs.root, inputs.lengths, inputs.target_cache)
        tree, cache = draft_chain(step, first, inputs.lengths, self.depth, sampling, rng, cache, self.tree_width)
        return tree, state, cache
