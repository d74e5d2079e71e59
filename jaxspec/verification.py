"""Tree verification: one target forward over the root and the drafted nodes, and the one acceptance rule.

The rule (recursive rejection sampling, Leviathan et al. / Chen et al., SpecInfer for trees): start at the root
with residual r = p(. | root). Try the current node's children in index order. A child with token x drafted
from q is accepted with probability min(1, r(x) / q(x)); then it becomes the current node and r = p(. | child).
On rejection r <- norm(max(0, r - q)). When no child is accepted, the bonus token is drawn from r.

- Sampled children (x ~ q, siblings drawn independently): the output is distributed exactly as p.
- Deterministic children (top-k, n-gram copies): q is the point mass on x, so the child is accepted with
  probability r(x) and a rejection removes x from r. Also exact.
- Greedy (temperature 0): p is a point mass on the argmax, so the same rule accepts exactly the child equal to
  the target's argmax and the bonus is the argmax. `accept_greedy` computes that outcome from the argmaxes alone
  (the general rule's vector work over the vocabulary cost a CPU round 1.0 ms at 1 node, 3.0 ms at 16);
  tests/test_lossless.py checks it equals `accept` on point masses.
- Deterministic children at a temperature alone: the target's own draw y ~ p at the current node (by the Gumbel-max
  rule, `jaxspec.sampling.gumbel_noise`) accepts the child whose token is y, else y is the bonus: child x with
  probability p(x), the bonus from p without the children tried, as above; so `accept_greedy` on the draws at the
  root and every node (independent draws) is the rule, and no full logits are needed (the speculative loop does this).

All randomness comes in as uniforms, so the rule is a deterministic function of them; tests integrate over the
uniforms exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import ForwardOutput, Weights
from jaxspec.sampling import (
    SamplingConfig,
    sample_from,
    target_probs,
    vocab_argmax,
    vocab_one_hot,
    vocab_pick,
    vocab_sum,
)
from jaxspec.sharding import DATA, MODEL, forward_on_mesh
from jaxspec.tree import DraftTree, ancestor_mask


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
    hidden_layers: tuple[int, ...] = (), mesh: Mesh | None = None, compute_logits: bool = True,
) -> ForwardOutput:
    """Runs the target on [root, nodes...] under the tree's ancestor mask at positions length + depth.

    root: int32[B], placed at position cache.lengths[b]. Returns logits [B, T+1, V] (None with compute_logits
    False: `jaxspec.model.greedy_tokens` takes the argmaxes from last_hidden); the keys and values of all
    T + 1 tokens are written at [lengths, lengths + T + 1) and nothing is committed. On a (data, model) mesh
    the forward is tensor-parallel under shard_map, each row's tree mask built on the device that holds the row.
    """
    tokens = jnp.concatenate([root[:, None], tree.tokens], axis=1)  # [B, T+1]
    mask = ancestor_mask(tree.parents)  # [B, T+1, T+1], built once: the depths are its row sums
    positions = cache.lengths[:, None] + jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1  # [B, T+1]: length + depth
    return forward_on_mesh(mesh, weights, cfg, tokens, positions, cache, mask, hidden_layers=hidden_layers,
                           compute_logits=compute_logits)


def acceptance_probability(residual: jax.Array, q: jax.Array, token: jax.Array,
                           vocab_axis: str | None = None) -> jax.Array:
    """min(1, r(x) / q(x)). residual, q: [V] (this device's slice with a vocab_axis); token: scalar."""
    qx, rx = vocab_pick(q, token, vocab_axis), vocab_pick(residual, token, vocab_axis)
    return jnp.where(qx > 0, jnp.minimum(1.0, rx / jnp.where(qx > 0, qx, 1.0)), 0.0)


def residual_after_rejection(residual: jax.Array, q: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """norm(max(0, r - q)). If that is all zero (r == q, when rejection cannot happen) r is kept."""
    left = jnp.maximum(residual - q, 0.0)
    total = vocab_sum(jnp.sum(left), vocab_axis)
    return jnp.where(total > 0, left / jnp.where(total > 0, total, 1.0), residual)


def _accept_row(tokens, parents, valid, draft_probs, target_probs, uniforms, bonus_uniform, vocab_axis=None):
    """One row. tokens/parents/valid: [T]; draft_probs: [T, V] or None; target_probs: [T+1, V]; uniforms: [T].

    With a vocab_axis (inside shard_map) the [.., V] arrays are this device's vocabulary slice; every decision
    is then taken from psum'd numbers, so all devices of the axis agree on it.
    """
    num_nodes, local_vocab = tokens.shape[0], target_probs.shape[-1]

    def visit(j, state):
        current, residual, path, count = state
        x = tokens[j]
        q = draft_probs[j] if draft_probs is not None else vocab_one_hot(x, local_vocab, vocab_axis, residual.dtype)
        is_child = valid[j] & (parents[j] + 1 == current)
        accepted = is_child & (uniforms[j] < acceptance_probability(residual, q, x, vocab_axis))
        rejected = is_child & ~accepted
        residual = jnp.where(accepted, target_probs[j + 1],
                             jnp.where(rejected, residual_after_rejection(residual, q, vocab_axis), residual))
        path = jnp.where(accepted, path.at[count + 1].set(j + 1), path)
        return (jnp.where(accepted, j + 1, current), residual, path, count + accepted.astype(jnp.int32))

    init = (jnp.int32(0), target_probs[0], jnp.zeros(num_nodes + 1, jnp.int32), jnp.int32(0))
    _, residual, path, count = jax.lax.fori_loop(0, num_nodes, visit, init)
    bonus = sample_from(residual, bonus_uniform, vocab_axis)
    return path, count, _new_tokens(tokens, path, count, bonus), bonus


def _new_tokens(tokens, path, count, bonus):
    """One row's new tokens, int32[T+1]: the `count` accepted nodes' tokens along `path` (int32[T+1], root first),
    then the bonus, zeros after. tokens: int32[T], by node."""
    node_tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), tokens])  # by verification index
    new_tokens = jnp.where(jnp.arange(tokens.shape[0] + 1) < count, node_tokens[jnp.roll(path, -1)], 0)
    return new_tokens.at[count].set(bonus)


def accept(tree: DraftTree, target_probs: jax.Array, uniforms: jax.Array, bonus_uniforms: jax.Array,
           vocab_axis: str | None = None) -> Acceptance:
    """Applies the acceptance rule to every row.

    Args:
        tree: the drafted nodes (T per row).
        target_probs: float32[B, T+1, V], p at the root and at every node (after temperature / top-k / top-p).
        uniforms: float32[B, T] in [0, 1), one per node; bonus_uniforms: float32[B].
        vocab_axis: inside shard_map, the mesh axis the vocabulary is split over (then target_probs and
            tree.draft_probs hold this device's slice [.., V/devices]).
    """
    path, count, new_tokens, bonus = jax.vmap(functools.partial(_accept_row, vocab_axis=vocab_axis))(
        tree.tokens, tree.parents, tree.valid, tree.draft_probs, target_probs, uniforms, bonus_uniforms
    )
    return Acceptance(path=path, num_accepted=count, tokens=new_tokens, bonus=bonus)


def _accept_greedy_row(tokens, parents, valid, best):
    """One row at temperature 0. tokens/parents/valid: [T]; best: int32[T+1], the target's argmax at the root and at
    every node."""
    num_nodes = tokens.shape[0]

    def visit(j, state):
        current, path, count = state
        accepted = valid[j] & (parents[j] + 1 == current) & (tokens[j] == best[current])
        path = jnp.where(accepted, path.at[count + 1].set(j + 1), path)
        return jnp.where(accepted, j + 1, current), path, count + accepted.astype(jnp.int32)

    init = (jnp.int32(0), jnp.zeros(num_nodes + 1, jnp.int32), jnp.int32(0))
    current, path, count = jax.lax.fori_loop(0, num_nodes, visit, init)
    bonus = best[current]
    return path, count, _new_tokens(tokens, path, count, bonus), bonus


def accept_greedy(tree: DraftTree, best: jax.Array) -> Acceptance:
    """The acceptance rule at temperature 0, from the target's argmax at the root and every node, best: int32[B, T+1]:
    from the root, the first child (in index order) whose token is the current node's argmax is accepted; the bonus
    is the argmax at the last accepted node. The same outcome as `accept` with p a point mass, whatever the draft's q
    (the argmax x has r(x) = 1 >= q(x); any other token has r = 0; a rejection leaves r the same point mass)."""
    path, count, new_tokens, bonus = jax.vmap(_accept_greedy_row)(tree.tokens, tree.parents, tree.valid,
                                                                  best.astype(jnp.int32))
    return Acceptance(path=path, num_accepted=count, tokens=new_tokens, bonus=bonus)


def verify_and_accept(tree: DraftTree, logits: jax.Array, sampling: SamplingConfig, uniforms: jax.Array,
                      bonus_uniforms: jax.Array, mesh: Mesh | None = None) -> Acceptance:
    """p from the verification logits [B, T+1, V] under `sampling`, then `accept`.

    On a (data, model) mesh this runs under shard_map: each device takes its rows and its vocabulary slice
    of the logits (as the tensor-parallel LM head left them); no device gathers the full logits.
    """
    if mesh is None:
        if sampling.greedy:
            return accept_greedy(tree, vocab_argmax(logits))  # argmax [B, T+1]
        return accept(tree, target_probs(logits, sampling), uniforms, bonus_uniforms)
    rows, rows_vocab = P(DATA, None), P(DATA, None, MODEL)
    tree_specs = DraftTree(tokens=rows, parents=rows, valid=rows,
                           draft_probs=None if tree.draft_probs is None else rows_vocab)

    def local(tree, logits, uniforms, bonus_uniforms):
        if sampling.greedy:
            return accept_greedy(tree, vocab_argmax(logits, MODEL))  # argmax [B_local, T+1], global ids
        probs = target_probs(logits, sampling, vocab_axis=MODEL)  # [B_local, T+1, V_local]
        return accept(tree, probs, uniforms, bonus_uniforms, vocab_axis=MODEL)

    out_specs = Acceptance(path=rows, num_accepted=P(DATA), tokens=rows, bonus=P(DATA))
    # check_vma=False: the per-row loop carries values that start as constants and become data-varying; every
    # value that leaves is identical across the model axis by construction (decisions come from psum'd numbers).
    return jax.shard_map(local, mesh=mesh, in_specs=(tree_specs, rows_vocab, rows, P(DATA)), out_specs=out_specs,
                         check_vma=False)(tree, logits, uniforms, bonus_uniforms)
