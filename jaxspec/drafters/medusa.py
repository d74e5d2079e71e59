"""Medusa (Cai et al. 2024): K extra heads on the target's last hidden state; head k predicts the token k + 2
steps ahead (the target's own head predicts the next one, the round's root).

Head k: h_k = x + SiLU(x W_k + b_k) on the final-normed hidden state x, then an LM head: the target's own,
frozen and shared (default), or a head of its own per Medusa head. Candidates: the top-k of each head combined
into a fixed tree ("choices": a path of ranks per node, depth i uses head i - 1). The heads do not see the
candidates above them, so the tree's tokens are deterministic top-k picks: q is a point mass and the core's
acceptance rule is lossless. (Medusa's "typical acceptance" is lossy and is not offered.)

Zero-initialised W_k, b_k make every head copy the target's next-token prediction: that is "untrained Medusa".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter, RoundInputs
from jaxspec.losses import decay_weights, masked_mean, per_position_loss
from jaxspec.model import Weights, rms_norm
from jaxspec.tree import DraftTree, choices_parents

# A 15-node tree for 3 heads, small enough that verifying it stays cheap on a CPU.
DEFAULT_CHOICES = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 2),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaConfig:
    """The `drafter:` section of a Medusa training config, also stored in Medusa checkpoints."""

    num_heads: int = 3
    choices: tuple[tuple[int, ...], ...] = DEFAULT_CHOICES
    own_lm_head: bool = False  # False: share the target's LM head (frozen)
    positions_per_row: int = 64  # training positions sampled per sequence (0: all); bounds the vocabulary products

    def make_drafter(self) -> "MedusaDrafter":
        return MedusaDrafter(num_heads=self.num_heads, choices=tuple(tuple(c) for c in self.choices))

    def init_params(self, target_cfg: ModelConfig, target_weights: Weights) -> "MedusaParams":
        return init_medusa_params(target_cfg, self.num_heads, self.own_lm_head, target_weights)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MedusaParams:
    """w: [K, d, d]; b: [K, d]; lm_head: [K, d, V] or None (share the target's LM head, frozen)."""

    w: jax.Array
    b: jax.Array
    lm_head: jax.Array | None = None


def init_medusa_params(target_cfg: ModelConfig, num_heads: int, own_lm_head: bool = False,
                       target_weights: Weights | None = None, dtype=jnp.float32) -> MedusaParams:
    """Zero residual blocks (each head starts as the target's next-token head); own LM heads start as copies."""
    d = target_cfg.hidden_size
    lm_head = None
    if own_lm_head:
        shared = target_weights.embed.T if target_weights.lm_head is None else target_weights.lm_head  # [d, V]
        lm_head = jnp.broadcast_to(shared, (num_heads, *shared.shape)).astype(dtype)
    return MedusaParams(w=jnp.zeros((num_heads, d, d), dtype), b=jnp.zeros((num_heads, d), dtype), lm_head=lm_head)


def medusa_logits(params: MedusaParams, target_weights: Weights, target_cfg: ModelConfig, hidden: jax.Array):
    """hidden: [..., d] target residual stream (before the final norm) -> float32 logits [..., K, V]."""
    x = rms_norm(hidden, target_weights.final_norm, target_cfg.rms_norm_eps)  # [..., d]
    h = x[..., None, :] + jax.nn.silu(jnp.einsum("...d,kde->...ke", x, params.w) + params.b)  # [..., K, d]
    if params.lm_head is not None:
        return jnp.einsum("...kd,kdv->...kv", h, params.lm_head, preferred_element_type=jnp.float32)
    if target_weights.lm_head is None:
        return jnp.einsum("...kd,vd->...kv", h, target_weights.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...kd,dv->...kv", h, target_weights.lm_head, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaDrafter(Drafter):
    """params: MedusaParams; state: float32[B, d], the target's hidden state at the last accepted token."""

    num_heads: int = 3
    choices: tuple[tuple[int, ...], ...] = DEFAULT_CHOICES
    name: str = "medusa"

    def __post_init__(self):
        depth = max(len(c) for c in self.choices)
        if depth > self.num_heads:
            raise ValueError(f"Medusa choices reach depth {depth} but there are only {self.num_heads} heads.")

    @property
    def num_nodes(self) -> int:
        return len(set(self.choices))

    def _topology(self):
        parents, ranks = choices_parents(list(self.choices))
        depth = np.zeros(len(parents), np.int32)
        for j, p in enumerate(parents):
            depth[j] = 0 if p < 0 else depth[p] + 1
        return parents, ranks, depth  # depth 0 = children of the root = head 0

    def init(self, params, target_cfg, prompt_tokens, prompt_lengths, prefill_out, cache_size, sampling):
        last = prefill_out.last_hidden  # [B, P, d]
        return jnp.take_along_axis(last, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, d]

    def propose(self, params, state, inputs: RoundInputs, target_cfg, sampling, rng):
        parents, ranks, depth = self._topology()
        logits = medusa_logits(params, inputs.target_weights, target_cfg, state)  # [B, K, V]
        top = jax.lax.top_k(logits, int(ranks.max()) + 1)[1].astype(jnp.int32)  # [B, K, R]
        tokens = top[:, depth, ranks]  # [B, T]
        b = tokens.shape[0]
        tree = DraftTree(tokens=tokens, parents=jnp.broadcast_to(jnp.asarray(parents), (b, len(parents))),
                         valid=jnp.ones((b, len(parents)), jnp.bool_))
        return tree, state, inputs.target_cache

    def update(self, params, state, inputs, verification, acceptance):
        last = jnp.take_along_axis(acceptance.path, acceptance.num_accepted[:, None], axis=1)  # [B, 1]
        return jnp.take_along_axis(verification.last_hidden, last[:, :, None], axis=1)[:, 0]  # [B, d]


def sample_positions(loss_mask: jax.Array, num_heads: int, count: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Picks `count` training positions t per row where at least head 0 has a target (loss_mask[t + 1]).

    loss_mask: bool[B, S]. Returns (positions int32[B, count], valid bool[B, count]); sampling without replacement,
    uniform over the eligible positions (rows with fewer get them all, the rest marked invalid).
    """
    b, s = loss_mask.shape
    eligible = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((b, 1), jnp.bool_)], axis=1)  # [B, S]
    scores = jnp.where(eligible, jax.random.uniform(key, (b, s)), -1.0)
    top_scores, positions = jax.lax.top_k(scores, min(count, s))
    return positions.astype(jnp.int32), top_scores >= 0


def medusa_loss(params: MedusaParams, target_weights: Weights, target_cfg: ModelConfig, hidden: jax.Array,
                loss_mask: jax.Array, key: jax.Array, *, kind: str = "forward_kl", decay: float = 0.8,
                positions_per_row: int = 64):
    """Distillation loss of the heads on a batch of sequences.

    Head k at position t is compared with the target's distribution at t + k + 1 (its prediction of token
    t + k + 2 given the true text), weighted by decay^k, where loss_mask[t + k + 1] holds. To keep the
    vocabulary-sized products affordable, `positions_per_row` positions t per row are sampled (0: all).

    Args:
        hidden: [B, S, d] the frozen target's last residual stream; loss_mask: bool[B, S]; key: PRNG key.
    Returns (loss, per-head losses [K]).
    """
    from jaxspec.model import lm_head

    k_heads = params.w.shape[0]
    b, s, _ = hidden.shape
    if positions_per_row:
        positions, valid = sample_positions(loss_mask, k_heads, positions_per_row, key)  # [B, P]
    else:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        valid = jnp.ones((b, s), jnp.bool_)
    gather = jax.vmap(lambda rows, idx: rows[jnp.clip(idx, 0, s - 1)])
    draft_logits = medusa_logits(params, target_weights, target_cfg, gather(hidden, positions))  # [B, P, K, V]
    per_head = []
    for k in range(k_heads):
        ahead = positions + k + 1  # [B, P]
        target_logits = jax.lax.stop_gradient(lm_head(target_weights, target_cfg, gather(hidden, ahead)))
        mask = valid & (ahead < s) & gather(loss_mask, ahead)
        per_head.append(masked_mean(per_position_loss(kind, draft_logits[:, :, k], target_logits), mask))
    per_head = jnp.stack(per_head)
    weights = decay_weights(k_heads, decay)
    return jnp.sum(weights * per_head) / jnp.sum(weights), per_head
