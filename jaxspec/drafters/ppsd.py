"""PPSD: pipelined speculative decoding drafted by the target's own first stage (training-free early exit).

The target's layers run as `num_stages` pipeline stages, one token per stage in flight (`jaxspec.pipeline`). The
token that enters stage 0 next is drafted from the newest token's first-stage output through the target's final
norm and LM head. It waits for stage 0, so its cost is not hidden (unlike SPD's input-state drafter,
`jaxspec.drafters.spd`). Design and the equivalent-acceptance metric: docs/spd.md.
"""

from __future__ import annotations

import dataclasses

from jaxspec.drafters.base import choose_draft
from jaxspec.model import lm_head
from jaxspec.pipeline import PipelineDrafter


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyExitPipelineDrafter(PipelineDrafter):
    """PPSD's drafter: the next token from the first stage's output (the newest token after stage 0) through the
    target's final norm and LM head; `tree_width` W - 1 siblings travel with it."""

    name: str = "ppsd"

    def propose(self, params, state, view, target_weights, target_cfg, sampling, rng):
        logits = lm_head(target_weights, target_cfg, view.out[0][:, None])[:, 0]  # [B, V]
        draft, q = choose_draft(logits, sampling, rng, self.tree_width)
        return draft, q, state

    def draft_cost_layers(self, target_cfg):
        return 1.0  # the early-exit head, counted as one layer (METHODS.md's equal-cost convention)
