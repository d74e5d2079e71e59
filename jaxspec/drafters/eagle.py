"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840) with EAGLE-2 dynamic draft trees (Li et al. 2024), as one drafter.

The head (one Llama-style decoder layer on top of the frozen target):
- Feature fusion: the target's residual stream after three layers (`feature_layers`, low / mid / high; default
  (2, L // 2, L - 3) for an L-layer target, (2, 15, 27) for SmolLM2-135M's 30) is concatenated and projected by
  `fc` [3d -> d] (no bias). The fused feature f_t of position t is the head's residual stream.
- Input: concat(rms_norm(embed(token), input_norm), rms_norm(feature, hidden_norm)) of width 2d, from which q, k
  and v are projected; attention with RoPE (the target's settings) over the head's own KV cache; o-projection into
  the residual stream (the feature), post-attention norm, SwiGLU MLP. The layer's output h (before the final norm)
  is the next draft step's feature, so later steps skip `fc`.
- Output: final norm, then the head's own LM head over a REDUCED draft vocabulary of Vd tokens. `d2t[i]` is the
  target id of draft id i: the Vd most frequent tokens of the regenerated data's responses, most frequent first,
  ties by id (`build_vocab_map`); `t2d` marks them. Draft logits are mapped to target ids (scattered, -inf
  elsewhere: `to_target_logits`) before anything compares them with the target.
- The token embedding is the target's, frozen and shared.

The pair at position t is (feature f_t, token x_{t+1}); its output predicts x_{t+2}.

Drafter state across rounds (`HeadState`): the head's KV cache (1 layer) and the "pending" pairs, the fused
target features of the tokens committed in the last round. The tokens that follow them are read from the loop's
history, so a pending pair at position t is (pending feature, history[t + 1]). The head's cache always ends where
the pending pairs begin, and they end at the target's committed length L (the root's position):
- After the prefill the pending pairs are all prompt positions: (f_0, x_1) ... (f_{n-1}, x_n = root). `init`
  cannot embed tokens (it does not see the target's weights), so it keeps the prompt's fused features and the first
  `propose` absorbs them (a `lax.cond` on the first round keeps every later round at the small static width).
- After a round that committed the root and a accepted nodes at positions L..L+a, `update` takes the target's
  features at those path nodes from the verification forward: a + 1 pairs, followed by the accepted drafts and the
  bonus (history), padded to the static width T + 1. The count is implicit: L' - cache length = a + 1.
- `propose` first runs the head on the pending pairs (writing its cache at their positions; padding lands beyond
  L' and is overwritten later), takes the output at the last valid pair as the root's draft state, then builds the
  tree.

EAGLE-2 dynamic tree with static shapes (`depth` D, `top_k` K, `num_nodes` N):
- Depth 1: the top-K draft tokens of the root distribution; score = log-prob.
- Each further depth: the head runs once on the K frontier nodes together, each at position L - 1 + its depth,
  attending to the committed cache (slots < L) plus its drafted ancestors and itself: the fed nodes' keys and values
  stay in a per-round buffer of (D - 1) * K slots and an ancestor mask selects them (`jaxspec.model._attention`'s
  "cache slots < length plus new entries under a mask"). Each frontier node's top-K children (K * K candidates,
  cumulative log-prob scores) join a pool; the top-K candidates by score are the next frontier.
- The pool (K + (D - 1) K^2 nodes) is reranked and the best N kept. A child's cumulative score never exceeds its
  parent's (log-probs are <= 0) and ties go to the lower pool index (parents are added before children), so the
  selection is ancestor-closed; sorting the kept nodes by pool index puts parents before children and siblings in
  rank order.
- The tree has parents (-1 = root), valid all true and draft_probs None: children are deterministic top-k picks,
  so the core's acceptance rule is exact at any temperature. Scores come from the head's softmax at temperature 1.

Training (`eagle3_loss`): training-time test (TTT), `ttt_steps` unrolled steps. Step 0: the pairs
(f_t, x_{t+1}) for every column t, causal attention, output h0_t predicts x_{t+2}. Step i > 0: the pairs
(h_{i-1} at column t, x_{t+i+1}) at RoPE position t + i; the query at column t attends to the step-0 keys of
positions <= t plus its own column's keys of steps 1..i: exactly what a depth-i tree node sees at inference (the
cache of the committed text plus its drafted ancestors). Loss at step i: forward KL between the draft
distribution at column t and the target's distribution at position t + i + 1 restricted to the draft vocabulary
(renormalised), masked by loss_mask[t + i + 1], weighted 0.8^i (the weights normalised to sum 1).

`d2t` lives in the parameters (so checkpoints carry it) as float32 token ids (exact below 2^24): an all-float
pytree trains under `jax.value_and_grad` and Optax unchanged; its gradient is zero, so AdamW (no decay on 1-D
leaves) never moves it.

EAGLE-1 and EAGLE-2 are the same module with other settings (methods `eagle` and `eagle2`, one checkpoint):
- the head works on the top layer alone (`feature_layers: [L-1]`), over the full vocabulary
  (`draft_vocab_size: 0`); `fc` is the identity and stays frozen, so the residual stream is the target's top-layer
  feature, and the final norm and LM head are the target's, frozen: the target's LM head gives the tokens. (EAGLE-1
  feeds concat(embedding, feature) through an FC into a standard decoder layer; here that FC is folded into the
  layer's q/k/v projections and the residual stream is the feature itself, EAGLE-3's layer layout.)
- training: `feature_loss_weight` (EAGLE-1: 1.0) adds smooth-L1 regression of the head's output onto the target's
  next feature (both through the final norm, as EAGLE-1 regresses normed last hidden states), beside the token
  loss (`token_loss_weight`, EAGLE-1: 0.1), with uniform feature noise (`feature_noise`, EAGLE-1: 0.1);
  `ttt_steps: 1` is EAGLE-1's teacher forcing.
- `eagle` drafts a static tree (`tree_choices`, Medusa-style paths of child ranks, e.g. [[0], [1], [0, 0]]): level
  by level the head runs on the nodes that have children, each attending to the cache and its ancestors, and node
  j's token is the rank-r token of its parent's draft distribution. `eagle2` drafts EAGLE-2's dynamic tree with the
  same head (`tree_choices` dropped).

Einsum letters: b batch, t new tokens (queries), u keys among the new or drafted tokens, s cache slots, d model
width, e the head's input width (2d) or the fused width (n d), k key/value heads, g query heads per kv head, h head
dim, f feed-forward width, v draft vocabulary, i earlier TTT steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, init_cache, write_new_entries
from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.drafters.base import Drafter, RoundInputs
from jaxspec.drafters.prompt_lookup import lookup_chain
from jaxspec.errors import UserError
from jaxspec.kernels import feature_major_product, small_product_columns
from jaxspec.losses import decay_weights, gamma_weights, masked_mean, per_position_loss
from jaxspec.model import (
    NEG_INF,
    Weights,
    _attention,
    apply_rope,
    causal_mask,
    converted_once,
    forward,
    lm_head,
    rms_norm,
    rope_inverse_frequencies,
    runs_per_layer,
)
from jaxspec.tree import DraftTree, choices_parents, merge_chain, select_nodes

# ---------------------------------------------------------------------------------------------- configuration


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """(low, mid, high) = (2, L // 2, L - 3), clipped to [0, L) and sorted: (2, 15, 27) for L = 30."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


# EAGLE-1's static tree for the `eagle` method when the checkpoint names none: 16 nodes, depth 5, wider near the
# root where acceptance is likeliest (paths of child ranks from the root).
DEFAULT_STATIC_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                       (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))


# The EAGLE-1 head (methods `eagle` and `eagle2`): the top layer's feature (feature_layers null with feature
# regression on), the full vocabulary, feature regression 1.0 + token loss 0.1, feature noise 0.1, teacher forcing,
# the default static tree. A `method: eagle` training config's drafter section overrides these.
EAGLE1_SETTINGS = dict(draft_vocab_size=0, ttt_steps=1, feature_loss_weight=1.0, token_loss_weight=0.1,
                       feature_noise=0.1, tree_choices=[list(c) for c in DEFAULT_STATIC_TREE])


def eagle1_config(target_cfg: ModelConfig) -> Eagle3Config:
    """The EAGLE-1 head's config for `target_cfg` (`EAGLE1_SETTINGS`, target defaults filled in)."""
    return Eagle3Config(**{**EAGLE1_SETTINGS, "tree_choices": DEFAULT_STATIC_TREE}).for_target(target_cfg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """The `drafter:` section of an EAGLE-3 training config, also stored in EAGLE-3 checkpoints.

    Attributes:
        feature_layers: target layers whose output is fused (low, mid, high); null: (2, L // 2, L - 3), or the
            top layer (L - 1) with feature regression (EAGLE-1).
        draft_vocab_size: Vd, the draft vocabulary (the most frequent response tokens); 0 or >= V: the whole
            vocabulary.
        depth: D, draft tree depth (head forwards per round: 1 on the pending pairs, then D - 1).
        top_k: K, children per expanded node and frontier width.
        num_nodes: N, drafted nodes verified per round (at most K + (D - 1) K^2).
        ttt_steps: unrolled training-time-test steps.
        init_scale: standard deviation of the head's random matrices.
        tree_choices: a static tree instead of the dynamic one (EAGLE-1): paths of child ranks from the root;
            `depth`, `top_k` and `num_nodes` are then ignored (T = the number of paths).
        feature_loss_weight: EAGLE-1's feature regression (smooth L1 between the head's output and the target's
            next feature), 0 = off (EAGLE-3). When on, the head needs one feature layer, its `fc` is the identity
            and it, the final norm and the LM head stay frozen (the target's LM head gives the tokens).
        token_loss_weight: weight of the token loss (EAGLE-1: 0.1 beside feature regression 1.0).
        feature_noise: EAGLE-1's training noise, uniform in [-a, a], added to the target features (0 = off).
        rope_theta, rope_scaling, rms_norm_eps: the head's own RoPE and RMSNorm epsilon, which may differ from the
            target's (an imported head runs as its trainers ran it: EAGLE trains Llama-3.1 heads at base 10000
            without scaling); null: the target's (`for_target` fills them in).
        feature_norm: an RMSNorm on each fused target layer before `fc` (SpecForge's `fc_norm`, its "EAGLE-3.1"
            heads); the params then carry `fc_norm`.
    """

    feature_layers: tuple[int, ...] | None = None
    draft_vocab_size: int = 4096
    depth: int = 5
    top_k: int = 4
    num_nodes: int = 16
    ttt_steps: int = 7
    init_scale: float = 0.02
    tree_choices: tuple[tuple[int, ...], ...] | None = None
    feature_loss_weight: float = 0.0
    token_loss_weight: float = 1.0
    feature_noise: float = 0.0
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float | None = None
    feature_norm: bool = False

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.ttt_steps < 1:
            raise UserError(f"drafter.depth, drafter.top_k and drafter.ttt_steps must be >= 1, got {self.depth}, "
                            f"{self.top_k} and {self.ttt_steps}.")
        pool = self.top_k + (self.depth - 1) * self.top_k ** 2
        if not 1 <= self.num_nodes <= pool:
            raise UserError(f"drafter.num_nodes must be between 1 and {pool} (top_k + (depth - 1) * top_k^2 "
                            f"candidates), got {self.num_nodes}.")
        if self.draft_vocab_size < 0:
            raise UserError(f"drafter.draft_vocab_size must be >= 0 (0: the whole vocabulary), got "
                            f"{self.draft_vocab_size}.")
        if self.tree_choices is not None:
            try:
                choices_parents([tuple(c) for c in self.tree_choices])
            except ValueError as e:
                raise UserError(f"drafter.tree_choices: {e}") from None
            if not self.tree_choices or any(not c or min(c) < 0 for c in self.tree_choices):
                raise UserError("drafter.tree_choices must be non-empty paths of ranks >= 0, e.g. [[0], [1], [0, 0]].")
        if self.feature_layers is not None and not self.feature_layers:
            raise UserError("drafter.feature_layers must name at least one target layer (or be null for the default).")
        if min(self.feature_loss_weight, self.token_loss_weight, self.feature_noise) < 0:
            raise UserError("drafter.feature_loss_weight, token_loss_weight and feature_noise must be >= 0.")
        if self.feature_loss_weight > 0 and self.feature_layers is not None and len(self.feature_layers) != 1:
            raise UserError("drafter.feature_loss_weight > 0 (EAGLE-1's feature regression) needs exactly one "
                            "feature layer, e.g. feature_layers: [29] (or null: the target's top layer).")

    def for_target(self, target_cfg: ModelConfig) -> Eagle3Config:
        """This config with the target-dependent defaults filled in (feature layers, Vd <= V, the head's RoPE and
        epsilon); checks ranges."""
        if self.feature_layers:
            layers = self.feature_layers
        elif self.feature_loss_weight > 0:  # EAGLE-1: the top layer
            layers = (target_cfg.num_layers - 1,)
        else:
            layers = default_feature_layers(target_cfg.num_layers)
        for i in layers:
            if not 0 <= i < target_cfg.num_layers:
                raise UserError(f"drafter.feature_layers has layer {i}, but the target has layers 0.."
                                f"{target_cfg.num_layers - 1}.")
        vocab = self.draft_vocab_size
        vocab = target_cfg.vocab_size if vocab == 0 or vocab > target_cfg.vocab_size else vocab
        return dataclasses.replace(
            self, feature_layers=tuple(layers), draft_vocab_size=vocab,
            rope_theta=target_cfg.rope_theta if self.rope_theta is None else float(self.rope_theta),
            rope_scaling=target_cfg.rope_scaling if self.rope_scaling is None else self.rope_scaling,
            rms_norm_eps=target_cfg.rms_norm_eps if self.rms_norm_eps is None else float(self.rms_norm_eps))

    def head_config(self, target_cfg: ModelConfig) -> ModelConfig:
        """The config the head's layer runs with: the target's, with the head's own RoPE and epsilon."""
        return head_model_config(target_cfg, self.rope_theta, self.rope_scaling, self.rms_norm_eps)

    def make_drafter(self) -> Eagle3Drafter:
        if self.feature_layers is None:
            raise ValueError("Eagle3Config.make_drafter needs concrete feature_layers; call for_target first.")
        if self.tree_choices is not None:
            choices = tuple(sorted({tuple(c) for c in self.tree_choices}, key=lambda c: (len(c), c)))
            return Eagle3Drafter(target_layers=tuple(self.feature_layers), depth=max(len(c) for c in choices),
                                 top_k=max(max(c) for c in choices) + 1, num_nodes=len(choices), choices=choices,
                                 **self._head_settings())
        return Eagle3Drafter(target_layers=tuple(self.feature_layers), depth=self.depth, top_k=self.top_k,
                             num_nodes=self.num_nodes, **self._head_settings())

    def _head_settings(self) -> dict[str, Any]:
        return dict(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps)

    def init_params(self, target_cfg: ModelConfig, target_weights: Weights, key: jax.Array | None = None,
                    vocab_counts: np.ndarray | None = None) -> Eagle3Params:
        """Fresh parameters. vocab_counts: int[V] response-token counts of the training data (None: all zero, so the
        draft vocabulary is the Vd lowest ids; the shapes, all a checkpoint load needs, are the same)."""
        cfg = self.for_target(target_cfg)
        counts = np.zeros(target_cfg.vocab_size, np.int64) if vocab_counts is None else vocab_counts
        d2t, _ = build_vocab_map(counts, cfg.draft_vocab_size)
        key = jax.random.key(0) if key is None else key
        return init_eagle3_params(target_cfg, target_weights, len(cfg.feature_layers), d2t, key, self.init_scale,
                                  identity_fc=self.feature_loss_weight > 0, feature_norm=self.feature_norm)


def head_model_config(target_cfg: ModelConfig, rope_theta: float | None = None,
                      rope_scaling: RopeScaling | None = None, rms_norm_eps: float | None = None) -> ModelConfig:
    """The target's config with a head's own RoPE and epsilon where given (None: the target's). The head's layer
    (`_project`, `_finish`, `head_logits`, `fuse_features`) runs with it; widths and heads stay the target's."""
    changes = {k: v for k, v in (("rope_theta", rope_theta), ("rope_scaling", rope_scaling),
                                 ("rms_norm_eps", rms_norm_eps)) if v is not None}
    return dataclasses.replace(target_cfg, **changes) if changes else target_cfg


# ---------------------------------------------------------------------------------------------- parameters


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Params:
    """The head's weights. n = len(feature_layers), d the target's width, Vd the draft vocabulary."""

    fc: jax.Array  # [n d, d]
    input_norm: jax.Array  # [d]
    hidden_norm: jax.Array  # [d]
    wq: jax.Array  # [2d, Hq, h]
    wk: jax.Array  # [2d, Hkv, h]
    wv: jax.Array  # [2d, Hkv, h]
    wo: jax.Array  # [Hq, h, d]
    mlp_norm: jax.Array  # [d]
    w_gate: jax.Array  # [d, f]
    w_up: jax.Array  # [d, f]
    w_down: jax.Array  # [f, d]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array  # [d, Vd]
    d2t: jax.Array  # float32[Vd]: target id of each draft id (float so the pytree is all-differentiable)
    fc_norm: jax.Array | None = None  # [n, d]: an RMSNorm weight per fused layer before fc (feature_norm), or None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FeatureMajorHead:
    """An EAGLE head's weights as the per-layer CPU forward runs them (`feature_major_head`; inference only, no
    training step sees it): every matrix [out, in], q, k, v fused and gate and up fused, multiplying feature-major
    activations [in, N] through `jaxspec.kernels.feature_major_product` (jaxspec's kernel at 2-16 columns), as the
    target's `FeatureMajorLayer` does. `_project`, `_finish`, `head_logits` and `fuse_features` take either layout."""

    fc: jax.Array  # [d, n d]
    input_norm: jax.Array  # [d]
    hidden_norm: jax.Array  # [d]
    wqkv: jax.Array  # [(Hq + 2 Hkv) h, 2d]
    wo: jax.Array  # [d, Hq h]
    mlp_norm: jax.Array  # [d]
    w_gate_up: jax.Array  # [2f, d]: the gate's rows, then the up projection's
    w_down: jax.Array  # [d, f]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array  # [Vd, d]
    d2t: jax.Array  # float32[Vd]
    fc_norm: jax.Array | None = None  # [n, d]


def feature_major_head(params: Eagle3Params) -> FeatureMajorHead:
    """The head in the per-layer CPU layout (`FeatureMajorHead`): the same weights, transposed and fused.

    Where every matrix entry of a float32 head is a bfloat16 value (a head stored in bfloat16, as the shipped ones
    are) and jaxspec's CPU kernels run, the matrices are kept in bfloat16: `feature_major_product` widens them exactly
    in registers, so the head computes the same numbers from half the bytes (a round's drafting reads the head's
    matrices from memory). The norms, the caches and the activations stay float32."""
    two_d = params.wq.shape[0]
    d = params.fc.shape[1]
    qkv = jnp.concatenate([params.wq.reshape(two_d, -1), params.wk.reshape(two_d, -1), params.wv.reshape(two_d, -1)],
                          axis=1)  # [2d, (Hq + 2 Hkv) h]
    matrices = dict(fc=params.fc.T, wqkv=qkv.T, wo=params.wo.reshape(-1, d).T,
                    w_gate_up=jnp.concatenate([params.w_gate, params.w_up], axis=1).T, w_down=params.w_down.T,
                    lm_head=params.lm_head.T)
    if _bfloat16_exact(matrices.values()) and jax.default_backend() == "cpu" and small_product_columns():
        matrices = {name: w.astype(jnp.bfloat16) for name, w in matrices.items()}
    return FeatureMajorHead(input_norm=params.input_norm, hidden_norm=params.hidden_norm, mlp_norm=params.mlp_norm,
                            final_norm=params.final_norm, d2t=params.d2t, fc_norm=params.fc_norm, **matrices)


def _bfloat16_exact(matrices) -> bool:
    """Whether every entry of these float32 matrices is a bfloat16 value (rounding to bfloat16 changes none)."""
    return all(w.dtype == jnp.float32 and bool(jnp.array_equal(w.astype(jnp.bfloat16).astype(jnp.float32), w))
               for w in matrices)


def _times(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times a feature-major matrix w [out, in] -> [..., out] (`feature_major_product` on x's rows)."""
    lead = x.shape[:-1]
    x_dtype = jnp.float32 if w.dtype == jnp.bfloat16 else w.dtype  # a bfloat16 matrix multiplies float32 columns
    out = feature_major_product(w, x.reshape(-1, x.shape[-1]).astype(x_dtype).T)  # [out, N]
    return out.T.reshape(*lead, w.shape[0])


def head_dtype(params: Eagle3Params | FeatureMajorHead):
    """The dtype the head computes in (and of the keys and values it caches): its parameters', the norms' where a
    `FeatureMajorHead` keeps its matrices in bfloat16."""
    return params.input_norm.dtype


def build_vocab_map(token_counts, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The draft vocabulary: the `draft_vocab_size` most frequent tokens, most frequent first, ties by lower id.

    Args:
        token_counts: int[V], how often each target token occurs in the training responses.
        draft_vocab_size: Vd, 1 <= Vd <= V.
    Returns:
        (d2t int32[Vd]: the target id of each draft id; t2d bool[V]: whether a target id is in the draft vocabulary).
    """
    counts = np.asarray(token_counts, np.int64)  # [V]
    v = counts.shape[0]
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}.")
    order = np.lexsort((np.arange(v), -counts))  # by count descending, then id ascending
    d2t = order[:draft_vocab_size].astype(np.int32)  # [Vd]
    t2d = np.zeros(v, np.bool_)
    t2d[d2t] = True
    return d2t, t2d


def with_draft_vocabulary(trained: Eagle3Params, fresh: Eagle3Params) -> Eagle3Params:
    """A trained head moved to another draft vocabulary, to fine-tune it there: every weight is the trained head's
    except the LM head, whose columns follow `fresh.d2t` (the new vocabulary): a token the trained head drafted
    keeps its trained column, a token new to it starts at the mean of the kept trained columns, so that it starts
    at an average trained token's logit and training sets it apart (`fresh`'s column, the target's LM head as
    `init_eagle3_params` makes it, is used only when no trained column is kept). The target's own columns are not
    on the trained head's scale: on SmolLM2 a head moved to a vocabulary that shares 4,751 of 8,192 tokens with its
    own drafted a new token first almost everywhere (first-draft top-1 0.43 -> 0.006 on GSM8K answers), with the
    mean it keeps 0.43.

    Args:
        trained: the head to move (its lm_head [d, Vd_old], d2t [Vd_old]).
        fresh: fresh parameters of the new settings (lm_head [d, Vd_new], d2t [Vd_new]); only its LM head and d2t
            are read.
    """
    old_ids = np.asarray(trained.d2t).astype(np.int64)  # [Vd_old], target ids
    new_ids = np.asarray(fresh.d2t).astype(np.int64)  # [Vd_new]
    old_column = np.full(max(old_ids.max(), new_ids.max()) + 1, -1)  # by target id: its trained column, or -1
    old_column[old_ids] = np.arange(len(old_ids))
    kept = old_column[new_ids]  # [Vd_new]
    trained_head = jnp.take(trained.lm_head, jnp.asarray(np.maximum(kept, 0)), axis=1)  # [d, Vd_new]
    is_kept = jnp.asarray(kept >= 0)[None, :]  # [1, Vd_new]
    new_column = fresh.lm_head  # [d, Vd_new]
    if (kept >= 0).any():
        mean = jnp.sum(jnp.where(is_kept, trained_head, 0), axis=1, keepdims=True) / np.sum(kept >= 0)  # [d, 1]
        new_column = jnp.broadcast_to(mean, fresh.lm_head.shape)
    lm_head = jnp.where(is_kept, trained_head, new_column).astype(fresh.lm_head.dtype)
    return dataclasses.replace(trained, lm_head=lm_head, d2t=fresh.d2t)


def response_token_counts(dataset, vocab_size: int) -> np.ndarray:
    """int64[V]: occurrences of every token in the responses (not the prompts) of a `RegeneratedDataset`."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(dataset.num_samples):
        response = dataset.sample(i)[int(dataset.prompt_lengths[i]):]  # [n_i]
        response = response[(response >= 0) & (response < vocab_size)]
        counts += np.bincount(response, minlength=vocab_size)
    return counts


def init_eagle3_params(target_cfg: ModelConfig, target_weights: Weights, num_features: int, d2t: np.ndarray,
                       key: jax.Array, scale: float = 0.02, dtype=jnp.float32, identity_fc: bool = False,
                       feature_norm: bool = False) -> Eagle3Params:
    """Random matrices (normal(0, scale)), norms at 1; the final norm and LM head start as the target's (the LM head
    restricted to the draft vocabulary's columns), so the output layer starts in the target's token space.
    identity_fc: `fc` is the identity (EAGLE-1: one feature layer, the head works in the target's feature space).
    feature_norm: with per-layer norms before fc (`fc_norm`, at 1)."""
    d, f, h = target_cfg.hidden_size, target_cfg.intermediate_size, target_cfg.head_dim
    hq, hk = target_cfg.num_heads, target_cfg.num_kv_heads
    keys = iter(jax.random.split(key, 8))

    def normal(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    shared = target_weights.embed.T if target_weights.lm_head is None else target_weights.lm_head  # [d, V]
    d2t = jnp.asarray(d2t, jnp.int32)  # [Vd]
    return Eagle3Params(
        fc=jnp.eye(d, dtype=dtype) if identity_fc else normal(num_features * d, d),
        input_norm=jnp.ones((d,), dtype), hidden_norm=jnp.ones((d,), dtype),
        wq=normal(2 * d, hq, h), wk=normal(2 * d, hk, h), wv=normal(2 * d, hk, h), wo=normal(hq, h, d),
        mlp_norm=jnp.ones((d,), dtype), w_gate=normal(d, f), w_up=normal(d, f), w_down=normal(f, d),
        final_norm=jnp.array(target_weights.final_norm, dtype, copy=True),  # a copy: training donates params
        lm_head=jnp.take(shared, d2t, axis=1).astype(dtype),
        d2t=d2t.astype(jnp.float32),
        fc_norm=jnp.ones((num_features, d), dtype) if feature_norm else None,
    )


# ---------------------------------------------------------------------------------------------- the head


def draft_to_target(params: Eagle3Params) -> jax.Array:
    """int32[Vd]: the target id of each draft id."""
    return jnp.round(jax.lax.stop_gradient(params.d2t)).astype(jnp.int32)


def target_to_draft_mask(params: Eagle3Params, vocab_size: int) -> jax.Array:
    """t2d, bool[V]: which target ids the draft vocabulary holds."""
    return jnp.zeros((vocab_size,), jnp.bool_).at[draft_to_target(params)].set(True)


def to_target_logits(params: Eagle3Params, draft_logits: jax.Array, vocab_size: int) -> jax.Array:
    """draft_logits: [..., Vd] -> [..., V] over target ids, -inf where the draft vocabulary has no token."""
    full = jnp.full((*draft_logits.shape[:-1], vocab_size), -jnp.inf, draft_logits.dtype)
    return full.at[..., draft_to_target(params)].set(draft_logits)


def fuse_features(params: Eagle3Params, hidden: jax.Array, eps: float | None = None) -> jax.Array:
    """hidden: [n, ..., d], the target's residual stream after each feature layer -> fused [..., d]. eps: the head's
    RMSNorm epsilon, needed by a head with per-layer norms (`fc_norm`)."""
    x = jnp.moveaxis(hidden, 0, -2)  # [..., n, d]
    if params.fc_norm is not None:
        if eps is None:
            raise ValueError("This head normalises each fused layer (fc_norm): pass the head's rms_norm_eps.")
        x = rms_norm(x.astype(params.fc_norm.dtype), params.fc_norm, eps)  # [..., n, d]
    x = x.reshape(*x.shape[:-2], -1).astype(head_dtype(params))  # [..., n d]
    if isinstance(params, FeatureMajorHead):
        return _times(x, params.fc)  # [..., d]
    return jnp.einsum("...e,ed->...d", x, params.fc)


def _project(params: Eagle3Params, cfg: ModelConfig, emb: jax.Array, feat: jax.Array, positions: jax.Array):
    """emb, feat: [B, T, d]; positions: int32[B, T] -> q [B, T, Hq, h], k, v [B, T, Hkv, h] (RoPE applied)."""
    eps = cfg.rms_norm_eps
    x = jnp.concatenate([rms_norm(emb.astype(feat.dtype), params.input_norm, eps),
                         rms_norm(feat, params.hidden_norm, eps)], axis=-1)  # [B, T, 2d]
    if isinstance(params, FeatureMajorHead):
        hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = _times(x, params.wqkv)  # [B, T, (Hq + 2 Hkv) h]
        q = qkv[..., : hq * h].reshape(*x.shape[:-1], hq, h)  # [B, T, Hq, h]
        k = qkv[..., hq * h: (hq + hkv) * h].reshape(*x.shape[:-1], hkv, h)  # [B, T, Hkv, h]
        v = qkv[..., (hq + hkv) * h:].reshape(*x.shape[:-1], hkv, h)  # [B, T, Hkv, h]
    else:
        q = jnp.einsum("bte,enh->btnh", x, params.wq)
        k = jnp.einsum("bte,ekh->btkh", x, params.wk)
        v = jnp.einsum("bte,ekh->btkh", x, params.wv)
    inv_freq = rope_inverse_frequencies(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _finish(params: Eagle3Params, cfg: ModelConfig, feat: jax.Array, attn: jax.Array) -> jax.Array:
    """feat: [B, T, d] residual stream; attn: [B, T, Hq, h] -> the layer's output h [B, T, d]."""
    if isinstance(params, FeatureMajorHead):
        x = feat + _times(attn.reshape(*attn.shape[:-2], -1), params.wo)  # [B, T, d]
        gate_up = _times(rms_norm(x, params.mlp_norm, cfg.rms_norm_eps), params.w_gate_up)  # [B, T, 2f]
        f = gate_up.shape[-1] // 2
        return x + _times(jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], params.w_down)
    x = feat + jnp.einsum("btnh,nhd->btd", attn, params.wo)
    hx = rms_norm(x, params.mlp_norm, cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", hx, params.w_gate)
    up = jnp.einsum("btd,df->btf", hx, params.w_up)
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, params.w_down)


def head_logits(params: Eagle3Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """h: [..., d] the head's output -> float32 draft logits [..., Vd]."""
    x = rms_norm(h, params.final_norm, cfg.rms_norm_eps)
    if isinstance(params, FeatureMajorHead):
        return _times(x, params.lm_head).astype(jnp.float32)  # [..., Vd]
    return jnp.einsum("...d,dv->...v", x, params.lm_head, preferred_element_type=jnp.float32)


def head_forward(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array,
                 positions: jax.Array, cache: KVCache | None = None, mask: jax.Array | None = None):
    """The head on T new pairs (feature, token), attending to the committed cache slots plus each other.

    Args:
        embed: [V, d] the target's embedding; tokens: int32[B, T] target ids; feats: [B, T, d]; positions: int32[B, T].
        cache: the head's cache (k, v [1, B, Hkv, S, h]); its slots [0, lengths) are visible. None: no context.
        mask: bool[B, T, T] among the new pairs (default causal).
    Returns:
        (h [B, T, d], k [B, T, Hkv, h], v [B, T, Hkv, h]).
    """
    b, t = tokens.shape
    mask = causal_mask(b, t) if mask is None else mask
    q, k, v = _project(params, cfg, jnp.take(embed, tokens, axis=0), feats, positions)
    if cache is None:
        attn = _attention(q, k, v, None, None, None, mask)
    else:
        attn = _attention(q, k, v, cache.k[0], cache.v[0], cache.lengths, mask)
    return _finish(params, cfg, feats, attn), k, v


# ---------------------------------------------------------------------------------------------- the draft tree
# (the pool is ranked by `jaxspec.tree.select_nodes`)


def expand_pool(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, cache: KVCache, h_root: jax.Array,
                depth: int, top_k: int, root_logits: jax.Array | None = None):
    """EAGLE-2's expansion: the candidate pool of a dynamic tree.

    Args:
        embed: [V, d]; cache: the head's cache with lengths = L (the root's position); h_root: [B, d], the head's
            output at the last committed pair (its logits give the root's children); root_logits: float32[B, Vd],
            `head_logits` at h_root when the caller has them already (None: computed here).
    Returns:
        (pool tokens int32[B, M] in target ids, pool parents int32[B, M] (pool index, -1 = root), pool scores
        float32[B, M] cumulative log-probs), M = K + (D - 1) K^2; depth d's candidates follow depth d - 1's.
    """
    b, _ = h_root.shape
    kk = top_k
    fed = max((depth - 1) * kk, 1)  # buffer slots of the nodes the head runs on
    m = kk + (depth - 1) * kk * kk
    d2t = draft_to_target(params)  # [Vd]
    lengths = cache.lengths  # [B]
    if root_logits is None:
        root_logits = head_logits(params, cfg, h_root)  # [B, Vd]
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(root_logits, axis=-1), kk)  # [B, K]
    pool_scores = jnp.full((b, m), -jnp.inf, jnp.float32).at[:, :kk].set(scores)  # [B, M]
    pool_ids = jnp.zeros((b, m), jnp.int32).at[:, :kk].set(ids)  # [B, M] draft ids
    pool_parents = jnp.full((b, m), -1, jnp.int32)  # [B, M]
    if depth > 1:
        slots = jnp.arange(kk)
        hkv, hd = cfg.num_kv_heads, cfg.head_dim
        carry = dict(
            ids=ids, scores=scores,  # [B, K] the frontier's draft ids and scores
            feats=jnp.broadcast_to(h_root[:, None], (b, kk, h_root.shape[-1])),  # [B, K, d] its parents' outputs
            index=jnp.broadcast_to(slots, (b, kk)).astype(jnp.int32),  # [B, K] its pool indices
            ancestors=jnp.broadcast_to(jax.nn.one_hot(slots, fed, dtype=jnp.bool_), (b, kk, fed)),  # [B, K, F]
            buf_k=jnp.zeros((b, fed, hkv, hd), head_dtype(params)),  # [B, F, Hkv, h]
            buf_v=jnp.zeros((b, fed, hkv, hd), head_dtype(params)),
            pool_scores=pool_scores, pool_ids=pool_ids, pool_parents=pool_parents,
        )

        def grow(c, j):  # feeds the frontier (depth j + 1, fed slots j K ..) at position L + j
            positions = jnp.broadcast_to(lengths[:, None] + j, (b, kk))  # [B, K]
            q, k, v = _project(params, cfg, jnp.take(embed, d2t[c["ids"]], axis=0), c["feats"], positions)
            buf_k = jax.lax.dynamic_update_slice(c["buf_k"], k.astype(c["buf_k"].dtype), (0, j * kk, 0, 0))
            buf_v = jax.lax.dynamic_update_slice(c["buf_v"], v.astype(c["buf_v"].dtype), (0, j * kk, 0, 0))
            attn = _attention(q, buf_k, buf_v, cache.k[0], cache.v[0], lengths, c["ancestors"])  # [B, K, Hq, h]
            h = _finish(params, cfg, c["feats"], attn)  # [B, K, d]
            child_scores, child_ids = jax.lax.top_k(jax.nn.log_softmax(head_logits(params, cfg, h), -1), kk)
            cum = (c["scores"][:, :, None] + child_scores).reshape(b, kk * kk)  # [B, K K]
            child_ids = child_ids.reshape(b, kk * kk).astype(jnp.int32)  # [B, K K]
            offset = kk + j * kk * kk
            pool_scores = jax.lax.dynamic_update_slice(c["pool_scores"], cum, (0, offset))
            pool_ids = jax.lax.dynamic_update_slice(c["pool_ids"], child_ids, (0, offset))
            pool_parents = jax.lax.dynamic_update_slice(c["pool_parents"], jnp.repeat(c["index"], kk, axis=1),
                                                        (0, offset))
            best_scores, best = jax.lax.top_k(cum, kk)  # [B, K] the next frontier
            parent_slot = best // kk  # [B, K]
            ancestors = jnp.take_along_axis(c["ancestors"], parent_slot[:, :, None], axis=1)  # [B, K, F]
            ancestors = ancestors | jax.nn.one_hot((j + 1) * kk + slots, fed, dtype=jnp.bool_)[None]
            return dict(ids=jnp.take_along_axis(child_ids, best, axis=1), scores=best_scores,
                        feats=jnp.take_along_axis(h, parent_slot[:, :, None], axis=1),
                        index=(offset + best).astype(jnp.int32), ancestors=ancestors, buf_k=buf_k, buf_v=buf_v,
                        pool_scores=pool_scores, pool_ids=pool_ids, pool_parents=pool_parents), None

        carry, _ = jax.lax.scan(grow, carry, jnp.arange(depth - 1))
        pool_scores, pool_ids, pool_parents = carry["pool_scores"], carry["pool_ids"], carry["pool_parents"]
    return d2t[pool_ids], pool_parents, pool_scores


def ranked_ids(logits: jax.Array, k: int) -> jax.Array:
    """int32[..., k]: the indices of the k largest logits [..., V], largest first, ties to the lower index (what
    `jax.lax.top_k` gives), by k argmax passes: for a few ids in a decoding round XLA:CPU may lower `top_k` to a full
    sort of the vocabulary (1.5 ms for 8,192 draft ids on 2 cores) where the passes take microseconds."""
    ids = []
    for _ in range(k):
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [...]
        ids.append(best)
        logits = jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], -jnp.inf, logits)
    return jnp.stack(ids, axis=-1)


def draft_tree(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, cache: KVCache, h_root: jax.Array, *,
               depth: int, top_k: int, num_nodes: int,
               root_logits: jax.Array | None = None) -> tuple[DraftTree, jax.Array]:
    """The dynamic tree of one round: `expand_pool`, then the best `num_nodes` nodes (`select_nodes`).
    root_logits: float32[B, Vd] the head's logits at h_root, when the caller has them (see `expand_pool`).

    Returns (DraftTree with T = num_nodes, draft_probs None; scores float32[B, T], each node's cumulative log-prob).
    """
    tokens, parents, scores = expand_pool(params, cfg, embed, cache, h_root, depth, top_k, root_logits)  # [B, M]
    keep, tree_parents = select_nodes(scores, parents, num_nodes)  # [B, N]
    tree = DraftTree(tokens=jnp.take_along_axis(tokens, keep, axis=1), parents=tree_parents,
                     valid=jnp.ones(keep.shape, jnp.bool_))
    return tree, jnp.take_along_axis(scores, keep, axis=1)


def static_tree(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, cache: KVCache, h_root: jax.Array,
                choices: tuple[tuple[int, ...], ...]) -> DraftTree:
    """A fixed-shape tree (EAGLE-1): node j is the rank-r token of its parent's draft distribution.

    Level by level (static shapes per level), the head runs on the nodes that have children at position
    L - 1 + depth, attending to the committed cache plus its ancestors (a buffer of T slots under the tree's static
    ancestor mask).

    Args:
        cache: the head's cache with lengths = L; h_root: [B, d]; choices: paths of ranks, sorted by depth then path.
    Returns:
        DraftTree with T = len(choices), draft_probs None.
    """
    parents, ranks = choices_parents(list(choices))  # [T] each, parents before children
    t = len(parents)
    b = h_root.shape[0]
    visible = np.eye(t, dtype=np.bool_)  # [T, T] ancestor-or-self (static: numpy, parents before children)
    for j in range(t):
        if parents[j] >= 0:
            visible[j] |= visible[parents[j]]
    depths = visible.sum(-1)  # [T], 1 for the root's children
    top = int(ranks.max()) + 1
    d2t = draft_to_target(params)  # [Vd]
    ids = jnp.zeros((b, t), jnp.int32)  # [B, T] draft ids
    first = jax.lax.top_k(head_logits(params, cfg, h_root), top)[1]  # [B, R]
    level = np.flatnonzero(depths == 1)
    ids = ids.at[:, level].set(first[:, ranks[level]])
    outputs = jnp.zeros((b, t, h_root.shape[-1]), h_root.dtype)  # [B, T, d] the head's output at fed nodes
    buf_k = jnp.zeros((b, t, cfg.num_kv_heads, cfg.head_dim), head_dtype(params))  # [B, T, Hkv, h]
    buf_v = jnp.zeros_like(buf_k)
    for depth in range(1, int(depths.max())):
        fed = np.array([j for j in np.flatnonzero(depths == depth) if np.any(parents == j)])  # [n]
        feats = jnp.where(jnp.asarray(parents[fed] < 0)[None, :, None], h_root[:, None],
                          outputs[:, np.maximum(parents[fed], 0)])  # [B, n, d]
        positions = jnp.broadcast_to(cache.lengths[:, None] + depth - 1, (b, len(fed)))  # [B, n]
        q, k, v = _project(params, cfg, jnp.take(embed, d2t[ids[:, fed]], axis=0), feats, positions)
        buf_k, buf_v = buf_k.at[:, fed].set(k.astype(buf_k.dtype)), buf_v.at[:, fed].set(v.astype(buf_v.dtype))
        mask = jnp.broadcast_to(jnp.asarray(visible[fed]), (b, len(fed), t))  # [B, n, T]
        h = _finish(params, cfg, feats, _attention(q, buf_k, buf_v, cache.k[0], cache.v[0], cache.lengths, mask))
        outputs = outputs.at[:, fed].set(h)
        best = jax.lax.top_k(head_logits(params, cfg, h), top)[1]  # [B, n, R]
        children = np.flatnonzero(depths == depth + 1)  # their parents are all in `fed`
        slot = np.searchsorted(fed, parents[children])
        ids = ids.at[:, children].set(best[:, slot, ranks[children]])
    return DraftTree(tokens=d2t[ids], parents=jnp.broadcast_to(jnp.asarray(parents), (b, t)),
                     valid=jnp.ones((b, t), jnp.bool_))


# ---------------------------------------------------------------------------------------------- the drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadState:
    """The state of a head drafter across rounds (EAGLE heads and the block heads of DFlash, DDTree, JetSpec).

    cache: the head's KVCache (k, v [1, B, Hkv, S, h], lengths [B]: where the pending pairs start);
    pending: [B, T+1, d] fused target features of the last round's committed tokens (the first L - lengths valid);
    prompt: [B, P, d] fused features of the prompt (absorbed by the first round); first: bool[], the first round."""

    cache: KVCache
    pending: jax.Array  # [B, T+1, d]
    prompt: jax.Array  # [B, P, d]
    first: jax.Array  # bool[]


ABSORB_CHUNK = 512  # pairs the head absorbs at once: a long prompt goes in chunks (see `absorb_pairs`)


def absorb_pairs(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, cache: KVCache, feats: jax.Array,
                 history: jax.Array, lengths: jax.Array, chunk: int = ABSORB_CHUNK) -> tuple[KVCache, jax.Array]:
    """Runs the head on the pending pairs and caches them.

    The pairs sit at positions cache.lengths + i, with features feats[:, i] and tokens history[pos + 1]; those
    before `lengths` (the target's committed length) are valid. More than `chunk` pairs (a prompt, in the first
    round) go `chunk` at a time, each chunk attending to the ones before it through the cache: the same outputs,
    with attention scores [B, H, chunk, S] instead of [B, H, W, S + W] (for an 8B target's 3,000-token prompts at
    batch 8 that was most of a device's memory, `jaxspec plan --method eagle3`).

    Args:
        cache: the head's cache; feats: [B, W, d]; history: int32[B, S]; lengths: int32[B].
    Returns:
        (the cache with the pairs written and lengths = `lengths`, h_root [B, d]: the output at the last valid pair).
    """
    b, w, d = feats.shape

    def absorb(cache, feats):  # feats [B, C, d] -> (cache with them written, outputs [B, C, d], positions [B, C])
        positions, tokens = pending_pairs(cache, history, feats.shape[1])  # [B, C] each
        h, k, v = head_forward(params, cfg, embed, tokens, feats, positions, cache)  # [B, C, d], [B, C, Hkv, h] x2
        return write_new_entries(cache, k.transpose(0, 2, 1, 3)[None], v.transpose(0, 2, 1, 3)[None]), h, positions

    if w <= chunk:
        cache, h, positions = absorb(cache, feats)
        return dataclasses.replace(cache, lengths=lengths), last_pair(h, positions, lengths)
    n = -(-w // chunk)
    chunks = jnp.pad(feats, ((0, 0), (0, n * chunk - w), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)

    def step(carry, feats):  # feats [B, C, d]: the next chunk
        cache, h_root = carry
        start = cache.lengths  # [B]
        cache, h, positions = absorb(cache, feats)
        h_root = jnp.where((start < lengths)[:, None], last_pair(h, positions, lengths), h_root)  # [B, d]
        return (dataclasses.replace(cache, lengths=jnp.minimum(start + chunk, lengths)), h_root), None

    h_dtype = jax.eval_shape(lambda c, f: absorb(c, f)[1], cache, chunks[0]).dtype
    (cache, h_root), _ = jax.lax.scan(step, (cache, jnp.zeros((b, d), h_dtype)), chunks)
    return dataclasses.replace(cache, lengths=lengths), h_root


def init_head_state(head: Eagle3Params, cfg: ModelConfig, prefill_out, cache_size: int,
                    num_nodes: int) -> HeadState:
    """The state of a head drafter after the prefill (EAGLE heads and the block heads): an empty one-layer cache,
    the prompt's fused features (absorbed by the first round), room for `num_nodes` + 1 pending features.
    cfg: the head's config (`head_model_config`)."""
    prompt = fuse_features(head, prefill_out.hidden, cfg.rms_norm_eps)  # [B, P, d]
    b = prompt.shape[0]
    cache = init_cache(cfg, b, cache_size, head_dtype(head), num_layers=1)
    return HeadState(cache=cache, pending=jnp.zeros((b, num_nodes + 1, prompt.shape[-1]), prompt.dtype),
                     prompt=prompt, first=jnp.array(True))


def keep_accepted_features(head: Eagle3Params, state: HeadState, verification, acceptance,
                           eps: float | None = None) -> HeadState:
    """The state after a round: the fused features of the root and the accepted nodes become the pending pairs of
    the next round (they start at the old committed length, the root's position, where the head's cache ends).
    eps: the head's RMSNorm epsilon (`fuse_features`)."""
    path = acceptance.path  # [B, T+1] verification indices of the root and the accepted nodes
    hidden = jnp.take_along_axis(verification.hidden, path[None, :, :, None], axis=2)  # [n, B, T+1, d]
    return dataclasses.replace(state, pending=fuse_features(head, hidden, eps).astype(state.pending.dtype))


def pending_pairs(cache: KVCache, history: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """(positions, tokens), int32[B, W] each, of the `width` pairs a head caches next: pair i sits at position
    cache.lengths + i and carries the token after it, history[position + 1] (EAGLE heads and the block heads)."""
    positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
    tokens = jnp.take_along_axis(history, jnp.clip(positions + 1, 0, history.shape[1] - 1), axis=1)  # [B, W]
    return positions, tokens


def last_pair(x: jax.Array, positions: jax.Array, lengths: jax.Array) -> jax.Array:
    """x: [B, W, d] per pending pair -> [B, d] at the last valid pair (position lengths - 1)."""
    last = jnp.clip(lengths - 1 - positions[:, 0], 0, x.shape[1] - 1)  # [B]
    return jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Drafter(Drafter):
    """params: Eagle3Params; state: HeadState. `target_layers` are the feature layers."""

    depth: int = 5
    top_k: int = 4
    num_nodes: int = 16  # the drafted nodes verified per round, the prompt-lookup chain's included
    choices: tuple[tuple[int, ...], ...] | None = None  # a static tree (EAGLE-1) instead of the dynamic one
    # a prompt-lookup chain of this many tokens merged into the head's tree (`jaxspec.tree.merge_chain`): the head
    # drafts num_nodes - lookup_depth nodes, the text's own repeats the rest (where the chain runs out, the head's
    # next-ranked first tokens); 0: the head alone
    lookup_depth: int = 0
    lookup_ngram: int = 3  # the longest n-gram the lookup matches
    rope_theta: float | None = None  # the head's own RoPE and epsilon (None: the target's; Eagle3Config)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float | None = None
    name: str = "eagle3"

    def __post_init__(self):
        if not 0 <= self.lookup_depth < self.num_nodes:
            raise UserError(f"The prompt-lookup chain ({self.lookup_depth} tokens) must leave the head at least one "
                            f"of the round's {self.num_nodes} nodes; raise the nodes or shorten the chain.")
        if self.lookup_depth and self.choices is not None:
            raise UserError("A prompt-lookup chain merges into dynamic trees only; this head drafts a fixed tree "
                            "(tree_choices).")

    def head_config(self, target_cfg: ModelConfig) -> ModelConfig:
        return head_model_config(target_cfg, self.rope_theta, self.rope_scaling, self.rms_norm_eps)

    def execution_params(self, params, mesh=None):
        """A float32 head runs feature-major where the target's layers do (the per-layer CPU layout)."""
        if isinstance(params, Eagle3Params) and params.fc.dtype == jnp.float32 and runs_per_layer(mesh):
            return converted_once(params, feature_major_head)
        return params

    @property
    def chain(self) -> bool:
        """One child per expanded node: the pool is a chain, and the best nodes of it, kept in pool order, its first
        ones (scores fall with depth, ties go to the lower index)."""
        return self.num_nodes == 1 or (self.top_k == 1 and self.choices is None and not self.lookup_depth)

    def init(self, params, target_cfg, prompt_tokens, prompt_lengths, prefill_out, cache_size, sampling):
        return init_head_state(params, self.head_config(target_cfg), prefill_out, cache_size, self.num_nodes)

    def propose(self, params, state: HeadState, inputs: RoundInputs, target_cfg, sampling, rng):
        embed = inputs.target_weights.embed
        target_cfg = self.head_config(target_cfg)  # the head's layer runs with its own RoPE and epsilon

        def absorb(feats):
            return absorb_pairs(params, target_cfg, embed, state.cache, feats, inputs.history, inputs.lengths)

        with jax.named_scope("eagle_absorb"):
            cache, h_root = jax.lax.cond(state.first, lambda: absorb(state.prompt), lambda: absorb(state.pending))
        with jax.named_scope("eagle_tree"):
            if self.choices is not None:
                tree = static_tree(params, target_cfg, embed, cache, h_root, self.choices)
            else:
                root_logits = head_logits(params, target_cfg, h_root)  # [B, Vd]
                tree, _ = draft_tree(params, target_cfg, embed, cache, h_root, depth=self.depth, top_k=self.top_k,
                                     num_nodes=self.num_nodes - self.lookup_depth, root_logits=root_logits)
        if self.lookup_depth:
            with jax.named_scope("prompt_lookup"):
                chain, valid = lookup_chain(inputs.history, inputs.lengths, self.lookup_depth, self.lookup_ngram)
                # the root's next-ranked children, for the chain's slots past its end (none when it matched)
                ranked = ranked_ids(root_logits, self.top_k + self.lookup_depth)  # [B, top_k + K] draft ids
                spares = draft_to_target(params)[ranked[:, self.top_k:]]  # [B, K]
                tree = merge_chain(tree, chain, valid, spares)
        return tree, dataclasses.replace(state, cache=cache, first=jnp.array(False)), inputs.target_cache

    def update(self, params, state: HeadState, inputs, verification, acceptance):
        return keep_accepted_features(params, state, verification, acceptance, self.rms_norm_eps)

    def draft_cost_layers(self, target_cfg):
        return float(self.depth)  # one decoder layer, `depth` forwards per round (m = depth, Ls = 1)

    def check_compatible(self, params, target_cfg, target_tokenizer=None):
        d = target_cfg.hidden_size
        if params.fc.shape != (len(self.target_layers) * d, d):
            raise UserError(f"This EAGLE-3 head fuses {params.fc.shape[0] // max(params.fc.shape[1], 1)} layers of "
                            f"width {params.fc.shape[1]}, which does not fit this target (width {d}).")


# ---------------------------------------------------------------------------------------------- training


def _shift(x: jax.Array, k: int, fill) -> jax.Array:
    """x: [B, S, ...] -> x[:, k:] padded at the end with `fill` back to S columns."""
    pad = jnp.full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def _ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, own_k: jax.Array | None, own_v: jax.Array | None):
    """Step i's attention: column t sees the step-0 keys of columns <= t and its own keys of steps 1..i.

    q: [B, S, Hq, h]; k0, v0: [B, S, Hkv, h]; own_k, own_v: [B, S, i, Hkv, h] or None (step 0). -> [B, S, Hq, h].
    """
    b, s, hq, h = q.shape
    hkv = k0.shape[2]
    q = q.reshape(b, s, hkv, hq // hkv, h) * (1.0 / math.sqrt(h))  # [b, t, k, g, h]
    scores = jnp.einsum("btkgh,bukh->bkgtu", q, k0, preferred_element_type=jnp.float32)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), jnp.bool_)), scores, NEG_INF)  # [b, k, g, t, u]
    if own_k is not None:
        own = jnp.einsum("btkgh,btikh->bkgti", q, own_k, preferred_element_type=jnp.float32)  # [b, k, g, t, i]
        scores = jnp.concatenate([scores, own], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtu,bukh->btkgh", probs[..., :s].astype(v0.dtype), v0)
    if own_v is not None:
        out = out + jnp.einsum("bkgti,btikh->btkgh", probs[..., s:].astype(own_v.dtype), own_v)
    return out.reshape(b, s, hq, h)


def ttt_logits(params: Eagle3Params, cfg: ModelConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array,
               steps: int, with_outputs: bool = False):
    """The unrolled head on whole sequences (training-time test).

    Args:
        embed: [V, d]; tokens: int32[B, S]; feats: [B, S, d] fused target features; steps: unrolled steps.
    Returns:
        `steps` draft logits [B, S, Vd]; step i at column t predicts token t + i + 2 from the head's own outputs of
        steps < i (the target's feature only at step 0). with_outputs: also the `steps` head outputs [B, S, d].
    """
    b, s = tokens.shape
    columns = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # [B, S]
    h = feats  # [B, S, d]
    k0 = v0 = None
    own_k, own_v, out, hs = [], [], [], []
    for i in range(steps):
        emb = jnp.take(embed, _shift(tokens, i + 1, 0), axis=0)  # [B, S, d]: token t + i + 1
        q, k, v = _project(params, cfg, emb, h, columns + i)
        if i == 0:
            k0, v0 = k, v
            attn = _ttt_attention(q, k0, v0, None, None)
        else:
            own_k.append(k)
            own_v.append(v)
            attn = _ttt_attention(q, k0, v0, jnp.stack(own_k, axis=2), jnp.stack(own_v, axis=2))
        h = _finish(params, cfg, h, attn)
        hs.append(h)
        out.append(head_logits(params, cfg, h))
    return (out, hs) if with_outputs else out


def eagle3_loss(params: Eagle3Params, target_weights: Weights, target_cfg: ModelConfig, tokens: jax.Array,
                hidden: jax.Array, target_last: jax.Array, loss_mask: jax.Array, *, steps: int,
                kind: str = "forward_kl", decay: float | None = 0.8, gamma: float | None = None,
                feature_weight: float = 0.0, token_weight: float = 1.0, noise: float = 0.0,
                key: jax.Array | None = None, head_cfg: ModelConfig | None = None):
    """The TTT distillation loss on a batch of sequences.

    Args:
        tokens: int32[B, S] text the target generated; hidden: [n, B, S, d] the target's feature layers;
        target_last: [B, S, d] its last layer's output (the loss needs its logits on the draft vocabulary only);
        loss_mask: bool[B, S] (True at t when token t + 1 is a response token).
        steps: unrolled steps; kind: see `jaxspec.losses`; decay / gamma: step weights decay^i or exp(-gamma i).
        feature_weight: EAGLE-1's feature regression: smooth L1 between the step-i output at column t and the
            target's feature (n = 1) at position t + i + 1, both after the final norm (EAGLE-1 regresses the
            target's normed last hidden state; the pre-norm residual stream has outliers in the hundreds); when
            > 0, fc, the final norm and the LM head are frozen.
        token_weight: weight of the token loss. noise: uniform feature noise amplitude (needs `key`).
        head_cfg: the head's config (`Eagle3Config.head_config`: its own RoPE and epsilon); None: the target's.
    Returns:
        (loss, metrics: loss_step{i} and acc_step{i}, the draft argmax (as a target id) equal to the text's next
        token, which is the target's argmax in text it generated at T=0; feature_step{i} with feature regression).
    """
    if feature_weight > 0:  # EAGLE-1: the head lives in the target's feature space; the target's LM head decodes
        params = dataclasses.replace(params, fc=jax.lax.stop_gradient(params.fc),
                                     final_norm=jax.lax.stop_gradient(params.final_norm),
                                     lm_head=jax.lax.stop_gradient(params.lm_head))
    d2t = draft_to_target(params)  # [Vd]
    # the target's logits of the draft vocabulary only, renormalised by the loss's softmax
    restricted = jax.lax.stop_gradient(lm_head(target_weights, target_cfg, target_last, d2t))  # [B, S, Vd]
    inputs = hidden
    if noise > 0:
        inputs = hidden + jax.random.uniform(key, hidden.shape, hidden.dtype, -noise, noise)  # [n, B, S, d]
    head_cfg = target_cfg if head_cfg is None else head_cfg
    logits, outputs = ttt_logits(params, head_cfg, target_weights.embed, tokens,
                                 fuse_features(params, inputs, head_cfg.rms_norm_eps), steps, with_outputs=True)
    losses, metrics = [], {}
    for i, step_logits in enumerate(logits):
        mask = _shift(loss_mask, i + 1, False)  # [B, S]: loss_mask[t + i + 1]
        token_loss = masked_mean(per_position_loss(kind, step_logits, _shift(restricted, i + 1, 0.0)), mask)
        losses.append(token_weight * token_loss)
        if feature_weight > 0:  # in the LM head's input space: both through the (frozen) final norm
            eps = target_cfg.rms_norm_eps
            error = (rms_norm(outputs[i], params.final_norm, eps)
                     - rms_norm(_shift(hidden[0], i + 1, 0.0).astype(outputs[i].dtype), params.final_norm, eps))
            smooth_l1 = jnp.where(jnp.abs(error) < 1.0, 0.5 * error ** 2, jnp.abs(error) - 0.5).mean(-1)  # [B, S]
            metrics[f"feature_step{i}"] = masked_mean(smooth_l1, mask)
            losses[-1] = losses[-1] + feature_weight * metrics[f"feature_step{i}"]
        hit = d2t[jnp.argmax(step_logits, axis=-1)] == _shift(tokens, i + 2, -1)  # [B, S]: token t + i + 2
        metrics[f"loss_step{i}"] = token_loss
        metrics[f"acc_step{i}"] = masked_mean(hit.astype(jnp.float32), mask)
    decay = 0.8 if decay is None else decay
    weights = gamma_weights(steps, gamma) if gamma is not None else decay_weights(steps, decay)  # [steps]
    return jnp.sum(weights * jnp.stack(losses)) / jnp.sum(weights), metrics


def eagle3_training_loss(params, mcfg: Eagle3Config, target_weights, target_cfg, features, loss_mask, loss_cfg,
                         key) -> tuple[jax.Array, dict[str, Any]]:
    """`eagle3_loss` with the training loop's `Trainable.loss` signature (features need tokens, hidden, logits)."""
    return eagle3_loss(params, target_weights, target_cfg, features.tokens, features.hidden, features.last_hidden,
                       loss_mask, steps=mcfg.ttt_steps, kind=loss_cfg.kind, decay=loss_cfg.position_decay,
                       gamma=loss_cfg.gamma, feature_weight=mcfg.feature_loss_weight,
                       token_weight=mcfg.token_loss_weight, noise=mcfg.feature_noise, key=key,
                       head_cfg=mcfg.head_config(target_cfg))


# ---------------------------------------------------------------------------------------------- acceptance profile


NOT_DRAFTABLE = 1 << 30  # the rank of a token the head cannot draft (outside the draft vocabulary, past the text)


def draft_ranks(params: Eagle3Params, target_weights: Weights, target_cfg: ModelConfig,
                feature_layers: tuple[int, ...], tokens: np.ndarray, lengths: np.ndarray, response_starts: np.ndarray,
                depth: int, head_cfg: ModelConfig | None = None) -> np.ndarray:
    """The head's ranks of the target's own tokens, depth by depth, along text the target generated.

    At every response position t of every row (a round whose root is token t + 1, everything up to it committed),
    runs the head as a round's chain does, fed the true tokens (`ttt_logits`, `depth` steps), and records where the
    target's token t + j + 2 ranks among the head's step-j candidates (0 = its top choice). As long as a round's
    drafts are accepted they are the true tokens, so these ranks decide exactly how much of a chain, or of a full
    tree of top-k children, the target accepts at T=0 (`jaxspec.budget.expected_tokens_per_round`).

    Args:
        feature_layers: the head's target layers.
        tokens: int[R, S] prompts followed by the target's greedy continuations, right-padded.
        lengths: int[R] real tokens per row; response_starts: int[R] index of each row's first generated token.
        depth: steps to measure.
        head_cfg: the head's config (`Eagle3Drafter.head_config`); None: the target's.
    Returns:
        int64[P, depth], one row per measured position; NOT_DRAFTABLE where the token is not in the draft
        vocabulary or lies beyond the row's text.
    """
    return draft_statistics(params, target_weights, target_cfg, feature_layers, tokens, lengths, response_starts,
                            depth, 0, head_cfg)[0]


def draft_statistics(params: Eagle3Params, target_weights: Weights, target_cfg: ModelConfig,
                     feature_layers: tuple[int, ...], tokens: np.ndarray, lengths: np.ndarray,
                     response_starts: np.ndarray, depth: int, top_k: int,
                     head_cfg: ModelConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`draft_ranks`, and what a sampled round (T > 0) keeps: at the same positions and depths, the target's
    probability (at temperature 1) of the head's top 1, 2, ... `top_k` candidates together.

    A round drafts the head's top-k children deterministically, and the acceptance rule keeps one of them with
    exactly the target's probability of that set (`jaxspec.verification`: a point-mass draft is accepted with
    probability r(x), and a rejection removes x from r), so these masses are the acceptance probabilities of a
    sampled round's levels along the given text (`jaxspec.budget.expected_tokens_sampled`; the calibration,
    `jaxspec.methods.measured_draft_ranks`, passes answers the target sampled at T=1: the text sampled rounds see).
    top_k 0: the ranks alone (mass [P, depth, 0]).

    Returns:
        (ranks int64[P, depth], mass float64[P, depth, top_k]: mass[p, j, k - 1] the target's probability of the
        head's top-k step-j candidates, 0 past the row's text).
    """
    toks = np.asarray(tokens, np.int64)  # [R, S]
    r, s = toks.shape
    d2t = np.asarray(draft_to_target(params))  # [Vd]
    t2d = np.full(target_cfg.vocab_size, -1, np.int64)  # [V]: draft id of each target id, -1 if none
    t2d[d2t] = np.arange(len(d2t))
    ranks = np.full((r, s, depth), NOT_DRAFTABLE, np.int64)  # [R, S, depth]
    mass = np.zeros((r, s, depth, top_k))  # [R, S, depth, K]
    for row in range(r):  # one row at a time: [depth, S, Vd] logits at most
        head_logits, target_logits = _chain_logits(params, target_weights, target_cfg, head_cfg or target_cfg,
                                                   tuple(feature_layers), jnp.asarray(toks[row: row + 1], jnp.int32),
                                                   depth, target_logits=top_k > 0)
        logits = np.asarray(head_logits)[:, 0]  # [depth, S, Vd]
        if top_k:
            probs = np.asarray(jax.nn.softmax(target_logits[0].astype(jnp.float32), axis=-1))  # [S, V]
            top = d2t[np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]]  # [depth, S, K] target ids
        for j in range(depth):  # column t predicts token t + j + 2
            wanted = np.full(s, -1, np.int64)  # [S]
            wanted[: max(s - j - 2, 0)] = t2d[toks[row, j + 2:]]
            own = np.take_along_axis(logits[j], np.maximum(wanted, 0)[:, None], axis=-1)  # [S, 1]
            rank = (logits[j] > own).sum(-1)  # [S]
            beyond = np.arange(s) + j + 2 >= lengths[row]
            ranks[row, :, j] = np.where((wanted < 0) | beyond, NOT_DRAFTABLE, rank)
            if top_k:  # the target's probabilities at column t + j + 1 (predicting token t + j + 2)
                at = np.minimum(np.arange(s) + j + 1, s - 1)  # [S]
                picked = np.take_along_axis(probs[at], top[j], axis=-1)  # [S, K]
                mass[row, :, j] = np.where(beyond[:, None], 0.0, np.cumsum(picked, axis=-1))
    # the first round's root is the first generated token (index response_start), so t runs from
    # response_start - 1 to the last column with a token to predict
    cols = np.arange(s)[None, :]
    measured = (cols >= np.asarray(response_starts)[:, None] - 1) & (cols + 2 < np.asarray(lengths)[:, None])
    return ranks[measured].astype(np.int64), mass[measured]


@functools.partial(jax.jit, static_argnames=("target_cfg", "head_cfg", "feature_layers", "depth", "target_logits"))
def _chain_logits(params, target_weights, target_cfg, head_cfg, feature_layers, tokens, depth, target_logits=False):
    """tokens: int32[R, S] -> ([depth, R, S, Vd] the head's step-j logits fed the true tokens (`ttt_logits`),
    [R, S, V] the target's logits, or None without `target_logits`)."""
    r, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))  # [R, S]
    out = forward(target_weights, target_cfg, tokens, positions, hidden_layers=feature_layers,
                  compute_logits=target_logits)
    feats = fuse_features(params, out.hidden, head_cfg.rms_norm_eps)  # [R, S, d]
    return jnp.stack(ttt_logits(params, head_cfg, target_weights.embed, tokens, feats, depth)), out.logits
