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

import jax.numpy as jnp

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

        def to_target_vocab(logits):  # [B, Vd] -> [B, V]: the target's ids, -inf where the drafter has none
            extra = target_cfg.vocab_size - cfg.vocab_size
            if extra >= 0:
                return jnp.pad(logits, ((0, 0), (0, extra)), constant_values=-jnp.inf)
            return logits[:, : target_cfg.vocab_size]

        def step(token, position, cache):
            cache = dataclasses.replace(cache, lengths=position)
            out = forward(params, cfg, token[:, None], position[:, None], cache)
            return to_target_vocab(out.logits[:, 0]), out.cache

        first = to_target_vocab(out.logits[:, 1])
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
