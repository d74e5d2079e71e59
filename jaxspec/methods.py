"""Method names -> drafters, so the CLI, the benchmark and notebooks build methods one way.

`autoregressive` is the baseline (no drafter). Every other method is a drafter on the one decoding loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.errors import UserError
from jaxspec.generate import GenerationResult, generate
from jaxspec.loading import LoadedModel, load_model
from jaxspec.sampling import GREEDY, SamplingConfig
from jaxspec.speculative import speculative_generate

METHODS = ("autoregressive", "draft-model", "prompt-lookup", "early-exit", "medusa", "eagle3")
LEARNED_METHODS = ("medusa", "eagle3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodOptions:
    """Method settings; None means the method's default for the target."""

    draft_model: str | None = None  # draft-model: a known name, .gguf or HF folder
    num_draft_tokens: int | None = None  # K, the draft depth per round
    tree_width: int = 1  # W top-k siblings per depth (draft-model, early-exit): T = K * W nodes
    ngram: int = 3  # prompt-lookup: longest n-gram matched
    exit_layer: int | None = None  # early-exit: layers used to draft
    drafter: str | None = None  # learned methods: a drafter checkpoint folder, or "untrained"


DEFAULT_DRAFT_TOKENS = {"draft-model": 4, "prompt-lookup": 4, "early-exit": 3}


@dataclasses.dataclass
class Method:
    """A ready method: `drafter` is None for autoregressive decoding."""

    name: str
    drafter: Any
    params: Any
    target: LoadedModel

    def generate(self, prompt_ids, *, max_new_tokens: int = 128, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 eos_ids=None, max_cache_length: int | None = None) -> GenerationResult:
        kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids,
                      max_cache_length=max_cache_length)
        t = self.target
        if self.drafter is None:
            return generate(t.weights, t.config, prompt_ids, **kwargs)
        return speculative_generate(t.weights, t.config, self.drafter, self.params, prompt_ids, **kwargs)


def build_method(name: str, target: LoadedModel, options: MethodOptions = MethodOptions()) -> Method:
    """Builds a method for `target`, refusing settings that cannot work with a clear error."""
    from jaxspec.drafters import DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter

    if name not in METHODS:
        raise UserError(f"Unknown method '{name}'; choose one of {', '.join(METHODS)}.")
    if name == "autoregressive":
        return Method(name=name, drafter=None, params=None, target=target)
    if name in LEARNED_METHODS:
        drafter, params = load_learned_drafter(name, target, options.drafter)
        return Method(name=name, drafter=drafter, params=params, target=target)
    k = options.num_draft_tokens if options.num_draft_tokens is not None else DEFAULT_DRAFT_TOKENS[name]
    if k < 1:
        raise UserError(f"--num-draft-tokens must be at least 1, got {k}.")
    width = options.tree_width
    if width < 1 or (name == "prompt-lookup" and width != 1):
        raise UserError(
            f"--tree-width {width} is not possible for {name}: use 1"
            + (" (prompt lookup copies one continuation)." if name == "prompt-lookup" else " or more.")
        )
    if name == "prompt-lookup":
        if options.ngram < 1:
            raise UserError(f"--ngram must be at least 1, got {options.ngram}.")
        return Method(name=name, drafter=PromptLookupDrafter(depth=k, max_ngram=options.ngram), params=None,
                      target=target)
    if name == "early-exit":
        layer = options.exit_layer if options.exit_layer is not None else max(1, target.config.num_layers // 4)
        drafter = EarlyExitDrafter(depth=k, tree_width=width, exit_layer=layer)
        drafter.check_compatible(None, target.config)
        return Method(name=name, drafter=drafter, params=None, target=target)
    # draft-model
    if options.draft_model is None:
        raise UserError(
            "The draft-model method needs --draft-model (a known name, .gguf file or Hugging Face folder of a smaller "
            "model with the target's tokenizer)."
        )
    draft = load_model(options.draft_model, dtype=target.weights.embed.dtype)
    drafter = DraftModelDrafter(depth=k, tree_width=width, draft_cfg=draft.config)
    drafter.check_compatible(draft.weights, target.config, target.tokenizer, draft.tokenizer)
    return Method(name=name, drafter=drafter, params=draft.weights, target=target)


def _method_config(method: str, config: dict):
    from jaxspec.configs import from_dict

    if method == "medusa":
        from jaxspec.drafters.medusa import MedusaConfig

        return from_dict(MedusaConfig, config, path="drafter")
    if method == "eagle3":
        from jaxspec.drafters.eagle import Eagle3Config

        return from_dict(Eagle3Config, config, path="drafter")
    raise UserError(f"Method '{method}' has no learned drafter.")


def load_learned_drafter(method: str, target: LoadedModel, path: str | None):
    """(drafter, params) from a drafter checkpoint trained for `target`, or freshly initialised for "untrained"."""
    if path is None:
        raise UserError(
            f"The {method} method needs --drafter: a drafter folder written by `jaxspec train`, or 'untrained' for "
            "freshly initialised weights (a baseline that shows what training adds)."
        )
    if path == "untrained":
        cfg = _method_config(method, {})
        cfg = cfg.for_target(target.config) if hasattr(cfg, "for_target") else cfg  # target-dependent defaults
        return cfg.make_drafter(), cfg.init_params(target.config, target.weights)
    from jaxspec.checkpoint import load_drafter, read_drafter_meta

    meta = read_drafter_meta(path)
    cfg = _method_config(method, meta.get("config", {}))
    cfg = cfg.for_target(target.config) if hasattr(cfg, "for_target") else cfg
    abstract = cfg.init_params(target.config, target.weights)
    _, params = load_drafter(path, expected_method=method, target_fingerprint=target.fingerprint(),
                             target_source=target.source, abstract_params=abstract)
    return cfg.make_drafter(), params
