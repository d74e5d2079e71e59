"""The block head shared by DFlash, DDTree and JetSpec, its config, its forwards and its training loss.

The head is the EAGLE-3 layer layout (`jaxspec.drafters.eagle`: fused multi-layer target features, one decoder layer
over (token embedding, feature) pairs, its own LM head over a reduced draft vocabulary with d2t) plus two learned
vectors, `mask_embedding` (the embedding of a mask token) and `mask_feature` (the feature of a position the target
has not processed). The three methods differ in the attention inside the drafted block (the head's training) and in
how a round's draft is built from the head's outputs (their own modules):
- `jaxspec.drafters.dflash`: a chain from the per-depth marginals of one block forward;
- `jaxspec.drafters.ddtree`: a best-first tree on the product of those marginals under a node budget;
- `jaxspec.drafters.jetspec`: the tree-causal head's best-first tree, re-scored by path-conditioned forwards.

Context. The committed text enters as pairs (fused target feature f_t, token x_{t+1}) at position t; their keys
and values are cached in the head's one-layer cache (the keys and values of a one-layer head depend on its input
pair only, so caching the pairs is a projection, not a forward). The root (the round's bonus token x_L) forms the
last pair (f_{L-1}, x_L).

The block forward (one head forward, D = `block_size` query slots at positions L-1 .. L-1+D-1):
- slot 0 is the root pair (f_{L-1}, x_L); slot j >= 1 is (mask_feature, mask_embedding), or (mask_feature,
  embed(token)) when the token at depth j is known (a tree node).
- slot j predicts the token at depth j + 1 (position L + j + 1).
- every slot sees the cached context (pairs < L-1) and, inside the block:
  - DFlash / DDTree (`attention: bidirectional`): every other slot of the block;
  - JetSpec (`attention: tree_causal`): its ancestors on its own path and itself, never siblings or
    descendants. On the all-mask chain this is plain causal attention.

Trees are deterministic top-W picks (draft_probs None), so the core's acceptance rule is exact at every
temperature. Scores are the head's log-softmax at temperature 1. Decision and cost: docs/jetspec.md.

Training (`parallel_loss`): every position a of a training sequence anchors one block: slot 0 is the pair
(f_a, x_{a+1}) at position a, slot j the mask (or, for the tree-causal head, with probability `real_token_rate`
per block, the true token x_{a+1+j}: the path-conditioned input a refresh forward sees), all at positions a + j;
slot j predicts x_{a+2+j}. The block sees the context pairs u < a. Loss at slot j: the chosen distillation loss
against the target's distribution at position a+1+j restricted to the draft vocabulary, weighted exp(-gamma j)
(`jaxspec.losses.gamma_weights`, the DFlash decay) and masked to response tokens.

Einsum letters: b batch, a anchors, j / i block slots (queries / keys), u context positions, k key/value heads,
g query heads per kv head, h head dim, d model width, v draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, write_new_entries
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter, RoundInputs
from jaxspec.drafters.eagle import (
    Eagle3Params,
    HeadState,
    _finish,
    _project,
    _shift,
    build_vocab_map,
    draft_to_target,
    fuse_features,
    head_logits,
    init_eagle3_params,
    init_head_state,
    keep_accepted_features,
    last_pair,
    pending_pairs,
)
from jaxspec.errors import UserError
from jaxspec.losses import gamma_weights, masked_mean, per_position_loss
from jaxspec.model import NEG_INF, Weights, _attention, lm_head
from jaxspec.tree import ancestor_mask

ATTENTION_KINDS = ("bidirectional", "tree_causal")


def spread_feature_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to the top: (1, 8, 15, 22, 29) for 30 layers."""
    if num_layers <= count:
        return tuple(range(num_layers))
    top = num_layers - 1
    return tuple(sorted({1 + (i * (top - 1)) // (count - 1) for i in range(count)}))


# ---------------------------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelHeadConfig:
    """The `drafter:` section of a DFlash / JetSpec training config, also stored in their checkpoints.

    Attributes:
        attention: "bidirectional" (DFlash; DDTree drafts with it) or "tree_causal" (JetSpec).
        feature_layers: target layers whose outputs are fused; null: five spread over the depth (1, 8, 15, 22, 29
            for 30 layers).
        draft_vocab_size: Vd, the draft vocabulary (the most frequent response tokens); 0 or >= V: all.
        block_size: D, query slots of one block forward = depths predicted in parallel.
        budget: B, drafted nodes verified per round (ddtree, jetspec); dflash drafts a chain of min(B, D).
        tree_width: W, children per node at most.
        refresh_steps: R, JetSpec's tree-causal re-scoring forwards after the marginal tree (0: none).
        real_token_rate: training, tree-causal head: probability that a block is fed its true tokens (the
            path-conditioned case) instead of masks.
        anchor_stride: training: a block is anchored at every n-th position (random offset per step); the cost of a
            step is about D / n times a plain forward over the sequence.
        init_scale: standard deviation of the head's random matrices.
    """

    attention: str = "tree_causal"
    feature_layers: tuple[int, ...] | None = None
    draft_vocab_size: int = 4096
    block_size: int = 8
    budget: int = 32
    tree_width: int = 4
    refresh_steps: int = 1
    real_token_rate: float = 0.5
    anchor_stride: int = 4
    init_scale: float = 0.02

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise UserError(f"drafter.attention must be one of {', '.join(ATTENTION_KINDS)}, got '{self.attention}'.")
        if self.block_size < 1 or self.budget < 1 or self.tree_width < 1 or self.refresh_steps < 0:
            raise UserError(f"drafter.block_size, budget and tree_width must be >= 1 and refresh_steps >= 0, got "
                            f"{self.block_size}, {self.budget}, {self.tree_width} and {self.refresh_steps}.")
        if self.anchor_stride < 1:
            raise UserError(f"drafter.anchor_stride must be >= 1, got {self.anchor_stride}.")
        if not 0.0 <= self.real_token_rate <= 1.0:
            raise UserError(f"drafter.real_token_rate must be in [0, 1], got {self.real_token_rate}.")
        if self.draft_vocab_size < 0:
            raise UserError(f"drafter.draft_vocab_size must be >= 0 (0: the whole vocabulary), got "
                            f"{self.draft_vocab_size}.")
        if self.feature_layers is not None and not self.feature_layers:
            raise UserError("drafter.feature_layers must name at least one target layer (or be null for the default).")

    def for_target(self, target_cfg: ModelConfig) -> ParallelHeadConfig:
        """This config with the target-dependent defaults filled in (feature layers, Vd <= V); checks ranges."""
        layers = tuple(self.feature_layers) if self.feature_layers else spread_feature_layers(target_cfg.num_layers)
        for i in layers:
            if not 0 <= i < target_cfg.num_layers:
                raise UserError(f"drafter.feature_layers has layer {i}, but the target has layers 0.."
                                f"{target_cfg.num_layers - 1}.")
        vocab = self.draft_vocab_size
        vocab = target_cfg.vocab_size if vocab == 0 or vocab > target_cfg.vocab_size else vocab
        if self.tree_width > vocab:
            raise UserError(f"drafter.tree_width {self.tree_width} exceeds the draft vocabulary ({vocab}).")
        return dataclasses.replace(self, feature_layers=layers, draft_vocab_size=vocab)

    def make_drafter(self, method: str | None = None) -> BlockHeadDrafter:
        """The drafter for `method` (dflash, ddtree, jetspec; None: dflash for a bidirectional head, else jetspec)."""
        from jaxspec.drafters.ddtree import DDTreeDrafter
        from jaxspec.drafters.dflash import DFlashDrafter
        from jaxspec.drafters.jetspec import JetSpecDrafter

        if self.feature_layers is None:
            raise ValueError("ParallelHeadConfig.make_drafter needs concrete feature_layers; call for_target first.")
        method = method or ("dflash" if self.attention == "bidirectional" else "jetspec")
        expected = "tree_causal" if method == "jetspec" else "bidirectional"
        if self.attention != expected:
            raise UserError(f"The {method} method needs a head trained with {expected} attention; this one has "
                            f"{self.attention} (train it with configs/{'jetspec' if method == 'jetspec' else 'dflash'}"
                            "-*.yaml).")
        common = dict(target_layers=tuple(self.feature_layers), block_size=self.block_size)
        if method == "dflash":
            return DFlashDrafter(**common, budget=min(self.budget, self.block_size))
        if method == "ddtree":
            return DDTreeDrafter(**common, budget=self.budget, tree_width=self.tree_width)
        return JetSpecDrafter(**common, budget=self.budget, tree_width=self.tree_width,
                              refresh_steps=self.refresh_steps)

    def init_params(self, target_cfg: ModelConfig, target_weights: Weights, key: jax.Array | None = None,
                    vocab_counts: np.ndarray | None = None) -> ParallelHeadParams:
        """Fresh parameters. vocab_counts: int[V] response-token counts (None: the Vd lowest ids)."""
        cfg = self.for_target(target_cfg)
        counts = np.zeros(target_cfg.vocab_size, np.int64) if vocab_counts is None else vocab_counts
        d2t, _ = build_vocab_map(counts, cfg.draft_vocab_size)
        key = jax.random.key(0) if key is None else key
        head_key, mask_key = jax.random.split(key)
        d = target_cfg.hidden_size
        head = init_eagle3_params(target_cfg, target_weights, len(cfg.feature_layers), d2t, head_key, self.init_scale)
        mask_embedding, mask_feature = (self.init_scale * jax.random.normal(mask_key, (2, d))).astype(head.fc.dtype)
        return ParallelHeadParams(head=head, mask_embedding=mask_embedding, mask_feature=mask_feature)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ParallelHeadParams:
    """head: the EAGLE-3 layer layout (fc, one decoder layer, final norm, LM head over Vd, d2t);
    mask_embedding: [d] the mask token's embedding; mask_feature: [d] the feature of a slot with no target feature."""

    head: Eagle3Params
    mask_embedding: jax.Array  # [d]
    mask_feature: jax.Array  # [d]


# ---------------------------------------------------------------------------------------------- the head


def block_forward(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, context: KVCache,
                  root_feature: jax.Array, tokens: jax.Array, real: jax.Array, positions: jax.Array,
                  mask: jax.Array) -> jax.Array:
    """One head forward over a block of N query slots; slot 0 is the root pair.

    Args:
        embed: [V, d] the target's embedding; context: the head's cache, slots [0, context.lengths) visible;
        root_feature: [B, d] the fused target feature f_{L-1}; tokens: int32[B, N] target ids (slot 0: the root);
        real: bool[B, N] whether slot j is fed embed(tokens[j]) (else the mask embedding; slot 0 always real);
        positions: int32[B, N]; mask: bool[B, N, N], which slots each slot sees.
    Returns:
        float32[B, N, Vd] draft logits; slot j's predict the token after it.
    """
    b, n = tokens.shape
    emb = jnp.where(real[..., None], jnp.take(embed, tokens, axis=0).astype(params.mask_embedding.dtype),
                    params.mask_embedding)  # [B, N, d]
    feats = jnp.concatenate([root_feature[:, None].astype(params.mask_feature.dtype),
                             jnp.broadcast_to(params.mask_feature, (b, n - 1, root_feature.shape[-1]))], axis=1)
    q, k, v = _project(params.head, cfg, emb, feats, positions)  # [B, N, Hq, h], [B, N, Hkv, h] x2
    attn = _attention(q, k, v, context.k[0], context.v[0], context.lengths, mask)  # [B, N, Hq, h]
    return head_logits(params.head, cfg, _finish(params.head, cfg, feats, attn))


def chain_block_mask(batch: int, block_size: int, attention: str) -> jax.Array:
    """bool[B, D, D] of the all-mask chain: all True (bidirectional) or lower triangular (tree-causal)."""
    full = np.ones((block_size, block_size), np.bool_)
    mask = full if attention == "bidirectional" else np.tril(full)
    return jnp.broadcast_to(jnp.asarray(mask), (batch, block_size, block_size))


def tree_block_mask(parents: jax.Array) -> jax.Array:
    """bool[B, T+1, T+1] the tree-causal mask over the root (slot 0) and T nodes: each sees itself and its
    ancestors. parents: int32[B, T] (-1 = root). The same mask as tree verification (`jaxspec.tree.ancestor_mask`)."""
    return ancestor_mask(parents)


def marginal_log_probs(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, context: KVCache,
                       root_feature: jax.Array, root: jax.Array, block_size: int, attention: str) -> jax.Array:
    """float32[B, D, Vd]: log-softmax of the all-mask block, depth d + 1 at index d."""
    b = root.shape[0]
    tokens = jnp.zeros((b, block_size), jnp.int32).at[:, 0].set(root)  # [B, D]
    real = jnp.zeros((b, block_size), jnp.bool_).at[:, 0].set(True)
    positions = context.lengths[:, None] + jnp.arange(block_size, dtype=jnp.int32)  # [B, D]: L-1 + j
    logits = block_forward(params, cfg, embed, context, root_feature, tokens, real, positions,
                           chain_block_mask(b, block_size, attention))
    return jax.nn.log_softmax(logits, axis=-1)


def cache_pairs(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, cache: KVCache, feats: jax.Array,
                history: jax.Array, lengths: jax.Array) -> tuple[KVCache, jax.Array]:
    """Caches the keys and values of the pending pairs (feats[:, i], history[pos + 1]) at pos = cache.lengths + i.

    Args:
        feats: [B, W, d]; history: int32[B, S]; lengths: int32[B] the target's committed length L.
    Returns:
        (the cache with lengths = L - 1: the root pair is cached but the block forward feeds it again as slot 0,
        root_feature [B, d]: the feature of the last valid pair, f_{L-1}).
    """
    positions, tokens = pending_pairs(cache, history, feats.shape[1])  # [B, W] each
    _, k, v = _project(params.head, cfg, jnp.take(embed, tokens, axis=0), feats, positions)  # [B, W, Hkv, h] x2
    cache = write_new_entries(cache, k.transpose(0, 2, 1, 3)[None], v.transpose(0, 2, 1, 3)[None])
    root_feature = last_pair(feats, positions, lengths)  # [B, d]
    return dataclasses.replace(cache, lengths=lengths - 1), root_feature


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockHeadDrafter(Drafter):
    """What DFlash, DDTree and JetSpec share: the head's context cache, its all-mask block forward, the features of
    the accepted tokens kept for the next round. params: ParallelHeadParams; state: HeadState (the state type of the
    EAGLE heads: the head's cache of context pairs, the pending features, the prompt's features, the first-round
    flag). A subclass builds the round's draft from the marginals (`draft`)."""

    block_size: int = 8
    budget: int = 32

    attention = "bidirectional"  # the block attention its head was trained with (a class constant)

    @property
    def num_nodes(self) -> int:
        return self.budget

    @property
    def depth(self) -> int:
        """The deepest node a round can draft."""
        return self.block_size

    def init(self, params, target_cfg, prompt_tokens, prompt_lengths, prefill_out, cache_size, sampling):
        return init_head_state(params.head, target_cfg, prefill_out, cache_size, self.num_nodes)

    def propose(self, params, state: HeadState, inputs: RoundInputs, target_cfg, sampling, rng):
        embed = inputs.target_weights.embed

        def absorb(feats):
            return cache_pairs(params, target_cfg, embed, state.cache, feats, inputs.history, inputs.lengths)

        with jax.named_scope("parallel_context"):
            context, root_feature = jax.lax.cond(state.first, lambda: absorb(state.prompt),
                                                 lambda: absorb(state.pending))
        with jax.named_scope("parallel_block"):
            log_probs = marginal_log_probs(params, target_cfg, embed, context, root_feature, inputs.root,
                                           self.block_size, self.attention)  # [B, D, Vd]
        tree = self.draft(params, log_probs, context, root_feature, inputs, target_cfg, sampling, rng)
        # the cache keeps lengths L - 1 during the round; `update` moves it on with the pending pairs
        state = dataclasses.replace(state, cache=dataclasses.replace(context, lengths=inputs.lengths),
                                    first=jnp.array(False))
        return tree, state, inputs.target_cache

    def draft(self, params, log_probs, context, root_feature, inputs: RoundInputs, target_cfg, sampling, rng):
        """The round's DraftTree from the marginals log_probs [B, D, Vd] (depth d + 1 at index d); `context` and
        `root_feature` let a subclass run more head forwards (JetSpec's refresh)."""
        raise NotImplementedError

    def update(self, params, state: HeadState, inputs, verification, acceptance):
        return keep_accepted_features(params.head, state, verification, acceptance)

    def draft_cost_layers(self, target_cfg):
        # one decoder layer per head forward (the context pairs are a projection, not counted)
        return 1.0

    def check_compatible(self, params, target_cfg, target_tokenizer=None):
        d = target_cfg.hidden_size
        fc = params.head.fc
        if fc.shape != (len(self.target_layers) * d, d):
            raise UserError(f"This {self.name} head fuses {fc.shape[0] // max(fc.shape[1], 1)} layers of width "
                            f"{fc.shape[1]}, which does not fit this target (width {d}).")


# ---------------------------------------------------------------------------------------------- training


def _block_attention(q, ctx_k, ctx_v, blk_k, blk_v, anchors, block_mask):
    """Attention of every anchor's block: context positions u < anchor plus the block's slots under block_mask.

    q: [B, A, D, Hq, h]; ctx_k, ctx_v: [B, S, Hkv, h]; blk_k, blk_v: [B, A, D, Hkv, h]; anchors: int32[A];
    block_mask: bool[B, A, D, D]. Returns [B, A, D, Hq, h].
    """
    b, a, dd, hq, h = q.shape
    hkv, s = ctx_k.shape[2], ctx_k.shape[1]
    q = q.reshape(b, a, dd, hkv, hq // hkv, h) * (1.0 / math.sqrt(h))  # [b, a, j, k, g, h]
    scores_ctx = jnp.einsum("bajkgh,bukh->bkgaju", q, ctx_k, preferred_element_type=jnp.float32)
    visible = jnp.arange(s)[None, :] < anchors[:, None]  # [A, S]
    scores_ctx = jnp.where(visible[None, None, None, :, None, :], scores_ctx, NEG_INF)
    scores_blk = jnp.einsum("bajkgh,baikh->bkgaji", q, blk_k, preferred_element_type=jnp.float32)
    scores_blk = jnp.where(block_mask[:, None, None], scores_blk, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([scores_ctx, scores_blk], axis=-1), axis=-1)
    out = jnp.einsum("bkgaju,bukh->bajkgh", probs[..., :s].astype(ctx_v.dtype), ctx_v)
    out = out + jnp.einsum("bkgaji,baikh->bajkgh", probs[..., s:].astype(blk_v.dtype), blk_v)
    return out.reshape(b, a, dd, hq, h)


def _gather_shifted(x: jax.Array, index: jax.Array, fill) -> jax.Array:
    """x: [B, S, ...]; index: int32[A, D] -> [B, A, D, ...] with x[:, index], `fill` where index >= S."""
    s = x.shape[1]
    out = jnp.take(x, jnp.minimum(index, s - 1), axis=1)
    inside = (index < s).reshape(1, *index.shape, *([1] * (x.ndim - 2)))
    return jnp.where(inside, out, jnp.asarray(fill, x.dtype))


def parallel_logits(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, tokens: jax.Array,
                    feats: jax.Array, anchors: jax.Array, block_size: int, attention: str,
                    real: jax.Array | None = None) -> jax.Array:
    """The head on one block per anchor of whole sequences (teacher-forced context).

    Args:
        embed: [V, d]; tokens: int32[B, S]; feats: [B, S, d] fused target features; anchors: int32[A] positions;
        real: bool[B, A] whether the anchor's block is fed its true tokens (tree-causal head only) or masks.
    Returns:
        float32[B, A, D, Vd]: slot j of anchor a predicts token a + 2 + j.
    """
    b, s = tokens.shape
    dd = block_size
    head = params.head
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # [B, S]
    _, ctx_k, ctx_v = _project(head, cfg, jnp.take(embed, _shift(tokens, 1, 0), axis=0), feats,
                               ctx_pos)  # the pairs (f_t, x_{t+1}) at positions t
    slot_index = anchors[:, None] + jnp.arange(dd, dtype=jnp.int32)[None]  # [A, D]: position a + j
    blk_tokens = _gather_shifted(tokens, slot_index + 1, 0)  # [B, A, D]: x_{a+1+j} (slot 0: the root token)
    is_real = jnp.zeros((b, anchors.shape[0], dd), jnp.bool_).at[:, :, 0].set(True)
    if real is not None:
        is_real = is_real | real[:, :, None]
    emb = jnp.where(is_real[..., None], jnp.take(embed, blk_tokens, axis=0).astype(params.mask_embedding.dtype),
                    params.mask_embedding)  # [B, A, D, d]
    root_feats = jnp.take(feats, anchors, axis=1)  # [B, A, d]
    blk_feats = jnp.concatenate([root_feats[:, :, None], jnp.broadcast_to(
        params.mask_feature, (b, anchors.shape[0], dd - 1, feats.shape[-1])).astype(feats.dtype)], axis=2)
    a = anchors.shape[0]
    flat = (b, a * dd)
    q, k, v = _project(head, cfg, emb.reshape(*flat, -1), blk_feats.reshape(*flat, -1),
                       jnp.broadcast_to(slot_index.reshape(1, -1), flat))
    q, k, v = (x.reshape(b, a, dd, *x.shape[2:]) for x in (q, k, v))
    block_mask = jnp.broadcast_to(chain_block_mask(1, dd, attention)[0], (b, a, dd, dd))
    attn = _block_attention(q, ctx_k, ctx_v, k, v, anchors, block_mask)  # [B, A, D, Hq, h]
    out = _finish(head, cfg, blk_feats.reshape(*flat, -1), attn.reshape(*flat, *attn.shape[3:]))
    return head_logits(head, cfg, out).reshape(b, a, dd, -1)


def parallel_loss(params: ParallelHeadParams, target_weights: Weights, target_cfg: ModelConfig, tokens: jax.Array,
                  hidden: jax.Array, target_last: jax.Array, loss_mask: jax.Array, key: jax.Array, *,
                  block_size: int, attention: str, kind: str = "forward_kl", gamma: float = 0.0,
                  real_token_rate: float = 0.5, anchor_stride: int = 1):
    """The block distillation loss on a batch of sequences.

    Args:
        tokens: int32[B, S] text the target generated; hidden: [n, B, S, d]; target_last: [B, S, d] the target's
        last layer's output (its logits are needed on the draft vocabulary only); loss_mask: bool[B, S] (True at t
        when token t + 1 is a response token); key: for the real/mask choice of each block (tree-causal head).
        kind: forward_kl | reverse_kl | sft; gamma: slot j weighs exp(-gamma j); anchor_stride: anchors every n
        positions from a random offset in [0, n).
    Returns:
        (loss, metrics: loss_slot{j}, acc_slot{j}: the draft argmax equals the text's next token, the target's
        argmax in text it generated at T=0).
    """
    b, s = tokens.shape
    offset_key, real_key = jax.random.split(key)
    offset = jax.random.randint(offset_key, (), 0, anchor_stride) if anchor_stride > 1 else 0
    anchors = jnp.minimum(offset + jnp.arange(0, s, anchor_stride, dtype=jnp.int32), s - 1)  # [A]
    real = None
    if attention == "tree_causal" and real_token_rate > 0:
        real = jax.random.bernoulli(real_key, real_token_rate, (b, anchors.shape[0]))  # [B, A]
    feats = fuse_features(params.head, hidden)  # [B, S, d]
    logits = parallel_logits(params, target_cfg, target_weights.embed, tokens, feats, anchors, block_size, attention,
                             real)  # [B, A, D, Vd]
    d2t = draft_to_target(params.head)
    target_logits = jax.lax.stop_gradient(lm_head(target_weights, target_cfg, target_last, d2t))  # [B, S, Vd]
    target_index = anchors[:, None] + 1 + jnp.arange(block_size, dtype=jnp.int32)[None]  # [A, D]: position a+1+j
    restricted = _gather_shifted(target_logits, target_index, 0.0)  # [B, A, D, Vd]
    mask = _gather_shifted(loss_mask, target_index, False)  # [B, A, D]
    best = _gather_shifted(tokens, target_index + 1, -1)  # [B, A, D]: token a+2+j, what position a+1+j predicts
    per_slot = per_position_loss(kind, logits, restricted)  # [B, A, D]
    weights = gamma_weights(block_size, gamma)  # [D]
    loss = masked_mean(per_slot, mask, weights)
    hit = (d2t[jnp.argmax(logits, axis=-1)] == best).astype(jnp.float32)  # [B, A, D]
    metrics: dict[str, Any] = {}
    for j in range(block_size):
        metrics[f"loss_slot{j}"] = masked_mean(per_slot[:, :, j], mask[:, :, j])
        metrics[f"acc_slot{j}"] = masked_mean(hit[:, :, j], mask[:, :, j])
    return loss, metrics


def parallel_training_loss(params, mcfg: ParallelHeadConfig, target_weights, target_cfg, features, loss_mask,
                           loss_cfg, key) -> tuple[jax.Array, dict[str, Any]]:
    """`parallel_loss` with the training loop's `Trainable.loss` signature."""
    return parallel_loss(params, target_weights, target_cfg, features.tokens, features.hidden, features.last_hidden,
                         loss_mask, key, block_size=mcfg.block_size, attention=mcfg.attention, kind=loss_cfg.kind,
                         gamma=0.0 if loss_cfg.gamma is None else loss_cfg.gamma,
                         real_token_rate=mcfg.real_token_rate, anchor_stride=mcfg.anchor_stride)
