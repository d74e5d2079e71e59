"""Draft model (Leviathan et al. 2023; Chen et al. 2023): a smaller causal LM with the same tokenizer drafts a
chain of K tokens; the target verifies them in one forward.

The drafter keeps its own KV cache. Each round it feeds the last two tokens [history[L-1], root] at positions
L-1 and L (L = the target's committed length), then K-1 drafted tokens. Re-feeding history[L-1] is harmless when
its entry is already cached (same token, same context) and needed when the previous round accepted every draft
(the last draft was never fed). So the drafter's cache needs no per-round bookkeeping: its valid prefix is always
[0, L-1), and slots beyond are rewritten before they are read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import init_cache
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import ChainDrafter, RoundInputs, draft_chain
from jaxspec.errors import UserError
from jaxspec.generate import prefill
from jaxspec.kernels import kernels_on
from jaxspec.model import Weights, bfloat16_feature_major_layers, converted_once, forward, runs_per_layer
from jaxspec.sampling import SamplingConfig

STORAGE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelDrafter(ChainDrafter):
    """params: the draft model's `Weights`; state: its KVCache.

    storage: the dtype of the draft model's layer matrices where it runs in the per-layer CPU layout with jaxspec's
    kernels: "bfloat16" (rounded once, read at half the bytes, computed in float32: a round's drafting streams the
    draft model's weights once per drafted token; `jaxspec.model.bfloat16_feature_major_layers`) or "float32" (as
    loaded). Elsewhere the weights run as loaded."""

    draft_cfg: ModelConfig
    storage: str = "bfloat16"
    name: str = "draft-model"

    def __post_init__(self):
        if self.storage not in STORAGE_DTYPES:
            raise UserError(f"The draft model's storage must be one of {', '.join(STORAGE_DTYPES)}; got "
                            f"{self.storage!r}.")

    def execution_params(self, params, mesh=None):
        if (self.storage == "bfloat16" and isinstance(params, Weights) and runs_per_layer(mesh) and kernels_on()
                and params.embed.dtype == jnp.float32 and not isinstance(params.layers, tuple)):
            return converted_once(params, bfloat16_feature_major_layers)
        return super().execution_params(params, mesh)

    def draft_cost_layers(self, target_cfg):
        # `depth` runs of the draft model, its layers weighed by width against the target's
        width = (self.draft_cfg.hidden_size * self.draft_cfg.intermediate_size) / (
            target_cfg.hidden_size * target_cfg.intermediate_size)
        return float(self.draft_cfg.num_layers * width * self.depth)

    def init(self, params, target_cfg, prompt_tokens, prompt_lengths, prefill_out, cache_size, sampling):
        cache = init_cache(self.draft_cfg, prompt_tokens.shape[0], cache_size, params.embed.dtype)
        _, _, cache = prefill(params, self.draft_cfg, prompt_tokens, prompt_lengths, cache)
        return cache

    def propose(self, params, state, inputs: RoundInputs, target_cfg, sampling: SamplingConfig, rng):
        cfg, length = self.draft_cfg, inputs.lengths  # [B]
        previous = jnp.take_along_axis(inputs.history, (length - 1)[:, None], axis=1)[:, 0]  # [B]
        tokens = jnp.stack([previous, inputs.root], axis=1)  # [B, 2]
        positions = jnp.stack([length - 1, length], axis=1)  # [B, 2]
        cache = dataclasses.replace(state, lengths=length - 1)
        out = forward(params, cfg, tokens, positions, cache)

        def step(token, position, cache):
            cache = dataclasses.replace(cache, lengths=position)
            out = forward(params, cfg, token[:, None], position[:, None], cache)
            return _target_vocabulary(out.logits[:, 0], target_cfg.vocab_size), out.cache  # [B, V]

        first = _target_vocabulary(out.logits[:, 1], target_cfg.vocab_size)  # [B, V]
        tree, cache = draft_chain(step, first, length, self.depth, sampling, rng, out.cache, self.tree_width)
        return tree, cache, inputs.target_cache

    def check_compatible(self, params, target_cfg, target_tokenizer=None, draft_tokenizer=None):
        check_same_vocabulary(target_cfg, self.draft_cfg, target_tokenizer, draft_tokenizer)


def check_same_vocabulary(target_cfg: ModelConfig, draft_cfg: ModelConfig, target_tokenizer=None,
                          draft_tokenizer=None) -> None:
    """Refuses a draft model whose tokens do not mean the same as the target's."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
            raise UserError(
                f"The draft model's tokenizer differs from the target's ({differing} vocabulary entries differ); "
                "a draft model must share the target's tokenizer. Pick a model of the same family."
            )
    limit = min(target_cfg.vocab_size, draft_cfg.vocab_size)
    if target_tokenizer is not None and len(target_tokenizer) > limit:
        raise UserError(
            f"The tokenizer has {len(target_tokenizer)} tokens but the draft model's vocabulary is only "
            f"{draft_cfg.vocab_size}; it cannot draft for this target."
        )


NOT_DRAFTED = 1 << 30  # `chain_statistics`: the rank of a token past the text's end (nothing to draft)


def chain_statistics(draft_weights: Weights, draft_cfg: ModelConfig, target_weights: Weights, target_cfg: ModelConfig,
                     tokens: np.ndarray, lengths: np.ndarray, response_starts: np.ndarray, depth: int,
                     temperature: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What a draft model's chain keeps along text (`jaxspec.budget.choose_tree` sizes its chain from these): at every
    position of the answers, a round's root, the rank of the text's next `depth` tokens among the draft model's
    logits, each fed the true text before it (teacher forcing: what a round drafts for as long as its drafts are
    accepted), and with a `temperature`, the chance a sampled round keeps each draft there.

    A sampled round draws each draft from the draft model's distribution q and keeps it with probability
    min(1, p/q) under the target's p (the same temperature), so a level is kept with sum_x min(p(x), q(x)); the
    masses take both distributions after the text's own tokens (the approximation `jaxspec.budget.
    expected_tokens_sampled` states for the EAGLE heads).

    Args:
        tokens: int[R, S] prompts followed by answers; lengths: int[R] their lengths; response_starts: int[R] where
            each answer starts (the first round's root). depth: the longest chain measured.
        temperature: None for the ranks alone (mass [P, depth, 0]).
    Returns:
        (ranks int64[P, depth]: ranks[p, j] the rank of the token j + 1 after root p under the draft model's logits
        at the token before it, NOT_DRAFTED past the text; mass float64[P, depth, 1]: the chance a sampled round
        keeps that level, 0 past the text).
    """
    toks = np.asarray(tokens, np.int64)  # [R, S]
    r, s = toks.shape
    lengths = np.asarray(lengths)  # [R]
    ranks = np.full((r, s, depth), NOT_DRAFTED, np.int64)  # [R, S, depth]
    mass = np.zeros((r, s, depth, 0 if temperature is None else 1))  # [R, S, depth, 1 or 0]
    for row in range(r):  # one row at a time: [S, V] logits at most
        row_tokens = jnp.asarray(toks[row: row + 1], jnp.int32)  # [1, S]
        draft = _target_vocabulary(_all_logits(draft_weights, draft_cfg, row_tokens)[0], target_cfg.vocab_size)
        following = np.zeros(s, np.int64)  # [S]: column t's next token, the one its logits draft
        following[: s - 1] = toks[row, 1:]
        own = jnp.take_along_axis(draft, jnp.asarray(following)[:, None], axis=-1)  # [S, 1]
        column_rank = np.asarray((draft > own).sum(-1))  # [S]
        has_next = np.arange(s) + 1 < lengths[row]  # [S]
        column_rank = np.where(has_next, column_rank, NOT_DRAFTED)
        if temperature is not None:
            target = _all_logits(target_weights, target_cfg, row_tokens)[0]  # [S, V]
            p = jax.nn.softmax(target.astype(jnp.float32) / temperature, axis=-1)  # [S, V]
            q = jax.nn.softmax(draft.astype(jnp.float32) / temperature, axis=-1)  # [S, V]
            column_kept = np.where(has_next, np.asarray(jnp.minimum(p, q).sum(-1)), 0.0)  # [S]
        for j in range(depth):  # a round rooted at column t drafts its level j + 1 from column t + j
            ranks[row, : s - j, j] = column_rank[j:]
            if temperature is not None:
                mass[row, : s - j, j, 0] = column_kept[j:]
    # the first round's root is the first generated token (index response_start); a root needs a token after it
    cols = np.arange(s)[None, :]
    measured = (cols >= np.asarray(response_starts)[:, None]) & (cols + 1 < lengths[:, None])
    return ranks[measured], mass[measured]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _all_logits(weights: Weights, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens: int32[R, S] -> float32[R, S, V] the model's logits at every position (no cache)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)  # [R, S]
    return forward(weights, cfg, tokens, positions).logits.astype(jnp.float32)


def _target_vocabulary(logits: jax.Array, vocab_size: int) -> jax.Array:
    """[..., Vd] -> [..., V]: a draft model's logits over the target's ids, -inf where the draft model has none."""
    extra = vocab_size - logits.shape[-1]
    if extra >= 0:
        return jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, extra)], constant_values=-jnp.inf)
    return logits[..., :vocab_size]
