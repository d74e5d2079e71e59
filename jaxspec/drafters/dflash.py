"""DFlash: the block head (`jaxspec.drafters.block_head`, bidirectional attention inside the block) drafts a chain.

One block forward on [root, mask x (D-1)] gives per-depth marginals; the chain is K <= D tokens, each depth's
argmax at T=0, or a sample from its marginal (the sampler's q kept for the acceptance rule) at T>0. `--budget` is
the chain length, at most the block size.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.drafters.block_head import BlockHeadDrafter
from jaxspec.drafters.eagle import draft_to_target
from jaxspec.sampling import process_logits, sample_categorical
from jaxspec.tree import DraftTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashDrafter(BlockHeadDrafter):
    """The chain of `budget` tokens (<= block_size) from one block forward."""

    name: str = "dflash"

    @property
    def depth(self) -> int:
        return self.budget

    def draft(self, params, log_probs, context, root_feature, inputs, target_cfg, sampling, rng) -> DraftTree:
        """The argmax (T=0) or a sample (T>0) of each depth's marginal, independently."""
        d2t = draft_to_target(params.head)  # [Vd]
        log_probs = log_probs[:, : self.budget]  # [B, K, Vd]
        b, k, _ = log_probs.shape
        parents = jnp.broadcast_to(jnp.arange(-1, k - 1, dtype=jnp.int32), (b, k))
        if sampling.greedy:
            return DraftTree(tokens=d2t[jnp.argmax(log_probs, axis=-1)], parents=parents,
                             valid=jnp.ones((b, k), jnp.bool_))
        full = jnp.full((b, k, target_cfg.vocab_size), -jnp.inf, jnp.float32).at[..., d2t].set(log_probs)
        logq = process_logits(full, sampling)  # [B, K, V]
        tokens = sample_categorical(rng, logq)  # [B, K]
        return DraftTree(tokens=tokens, parents=parents, valid=jnp.ones((b, k), jnp.bool_), draft_probs=jnp.exp(logq))
