"""Tree verification: one target forward over the root and the drafted nodes, and the one acceptance rule.

The rule (recursive rejection sampling, Leviathan et al. / Chen et al., SpecInfer for trees): start at the root
with residual r = p(. | root). Try the current node's children in index order. A child with token x drafted
from q is accepted with probability min(1, r(x) / q(x)); then it becomes the current node and r = p(. | child).
On rejection r <- norm(max(0, r - q)). When no child is accepted, the bonus token is drawn from r.

- Sampled children (x ~ q, siblings drawn independently): the output is distributed exactly as p.
- Deterministic children (top-k, n-gram copies): q is the point mass on x, so the child is accepted with
  probability r(x) and a rejection removes x from r. Also exact.
- Greedy (temperature 0): p is a point mass on the argmax, so the same rule accepts exactly the child equal to
  the target's argmax and the bonus is the argmax.

All randomness comes in as uniforms, so the rule is a deterministic function of them; tests integrate over the
uniforms exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import ForwardOutput, Weights, forward
from jaxspec.tree import DraftTree, ancestor_mask, tree_positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Acceptance:
    """The outcome of one verification round, per row.

    path: int32[B, T+1] verification indices of the accepted path, the root (0) first; entries past
    num_accepted are 0. num_accepted: int32[B], drafted tokens accepted. tokens: int32[B, T+1], the accepted
    drafted tokens followed by the bonus token (entries after it are 0): num_accepted + 1 new tokens.
    bonus: int32[B].
    """

    path: jax.Array  # int32[B, T+1]
    num_accepted: jax.Array  # int32[B]
    tokens: jax.Array  # int32[B, T+1]
    bonus: jax.Array  # int32[B]


def verify_forward(
    weights: Weights, cfg: ModelConfig, cache: KVCache, root: jax.Array, tree: DraftTree,
    hidden_layers: tuple[int, ...] = (),
) -> ForwardOutput:
    """Runs the target on [root, nodes...] under the tree's ancestor mask at positions length + depth.

    root: int32[B], placed at position cache.lengths[b]. Returns logits [B, T+1, V]; the keys and values of all
    T + 1 tokens are written at [lengths, lengths + T + 1) and nothing is committed.
    """
    tokens = jnp.concatenate([root[:, None], tree.tokens], axis=1)  # [B, T+1]
    positions = tree_positions(tree.parents, cache.lengths)  # [B, T+1]
    return forward(weights, cfg, tokens, positions, cache, ancestor_mask(tree.parents), hidden_layers=hidden_layers)


def acceptance_probability(residual: jax.Array, q: jax.Array, token: jax.Array) -> jax.Array:
    """min(1, r(x) / q(x)). residual, q: [V]; token: scalar."""
    qx = q[token]
    return jnp.where(qx > 0, jnp.minimum(1.0, residual[token] / jnp.where(qx > 0, qx, 1.0)), 0.0)


def residual_after_rejection(residual: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, r - q)). If that is all zero (r == q, when rejection cannot happen) r is kept."""
    left = jnp.maximum(residual - q, 0.0)
    total = jnp.sum(left)
    return jnp.where(total > 0, left / jnp.where(total > 0, total, 1.0), residual)


def sample_from(probs: jax.Array, uniform: jax.Array) -> jax.Array:
    """Inverse-CDF draw from probs [V] (unnormalised is fine) with a uniform in [0, 1); never a zero-mass token."""
    cdf = jnp.cumsum(probs)
    above = cdf > uniform * cdf[-1]
    last_nonzero = probs.shape[0] - 1 - jnp.argmax((probs > 0)[::-1])
    return jnp.where(jnp.any(above), jnp.argmax(above), last_nonzero).astype(jnp.int32)


def _accept_row(tokens, parents, valid, draft_probs, target_probs, uniforms, bonus_uniform):
    """One row. tokens/parents/valid: [T]; draft_probs: [T, V] or None; target_probs: [T+1, V]; uniforms: [T]."""
    num_nodes, vocab = tokens.shape[0], target_probs.shape[-1]

    def visit(j, state):
        current, residual, path, count = state
        x = tokens[j]
        q = draft_probs[j] if draft_probs is not None else jax.nn.one_hot(x, vocab, dtype=residual.dtype)
        is_child = valid[j] & (parents[j] + 1 == current)
        accepted = is_child & (uniforms[j] < acceptance_probability(residual, q, x))
        rejected = is_child & ~accepted
        residual = jnp.where(accepted, target_probs[j + 1],
                             jnp.where(rejected, residual_after_rejection(residual, q), residual))
        path = jnp.where(accepted, path.at[count + 1].set(j + 1), path)
        return (jnp.where(accepted, j + 1, current), residual, path, count + accepted.astype(jnp.int32))

    init = (jnp.int32(0), target_probs[0], jnp.zeros(num_nodes + 1, jnp.int32), jnp.int32(0))
    _, residual, path, count = jax.lax.fori_loop(0, num_nodes, visit, init)
    bonus = sample_from(residual, bonus_uniform)
    node_tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), tokens])  # by verification index
    new_tokens = jnp.where(jnp.arange(num_nodes + 1) < count, node_tokens[jnp.roll(path, -1)], 0)
    new_tokens = new_tokens.at[count].set(bonus)
    return path, count, new_tokens, bonus


def accept(tree: DraftTree, target_probs: jax.Array, uniforms: jax.Array, bonus_uniforms: jax.Array) -> Acceptance:
    """Applies the acceptance rule to every row.

    Args:
        tree: the drafted nodes (T per row).
        target_probs: float32[B, T+1, V], p at the root and at every node (after temperature / top-k / top-p).
        uniforms: float32[B, T] in [0, 1), one per node; bonus_uniforms: float32[B].
    """
    path, count, new_tokens, bonus = jax.vmap(_accept_row)(
        tree.tokens, tree.parents, tree.valid, tree.draft_probs, target_probs, uniforms, bonus_uniforms
    )
    return Acceptance(path=path, num_accepted=count, tokens=new_tokens, bonus=bonus)
