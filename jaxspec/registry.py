"""Every decoding method in one table: what the CLI, `jaxspec bench`, `jaxspec train`, the notebooks and the tests
read to know a method (its family, its drafter checkpoint, the options it takes, what `--budget auto` sizes).

Adding a method is its drafter module plus one `MethodSpec` entry here (and, for a new family, its builder in
`jaxspec.methods`); the registry-driven tests (`tests/test_registry.py`) then run it through the decoding loop.
This module imports nothing heavy: the CLI reads it before any model loads.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal

from jaxspec.errors import UserError

# The option fields of `jaxspec.methods.MethodOptions` a method may take, and their command-line flags.
OPTION_FLAGS = {
    "draft_model": "--draft-model",
    "num_draft_tokens": "--num-draft-tokens",
    "tree_width": "--tree-width",
    "tree_nodes": "--tree-nodes",
    "lookup_tokens": "--lookup-tokens",
    "ngram": "--ngram",
    "exit_layer": "--exit-layer",
    "drafter": "--drafter",
    "budget": "--budget",
    "refresh_steps": "--refresh-steps",
    "num_stages": "--num-stages",
    "stage_devices": "--stage-devices",
}

# What `--budget auto` sizes: "tree" the EAGLE dynamic tree (depth, top_k, nodes; also the default when no tree is
# given by hand), "chain" a draft model's chain length (also the default when neither --num-draft-tokens nor
# --tree-width is given), "budget" the drafted nodes per round of the parallel heads (also the default when no budget
# is given); all on one device (with --mesh, the drafter's own tree, chain or budget unless --budget auto is given).
AutoKind = Literal["tree", "chain", "budget"] | None
# The families, each built by one function of `jaxspec.methods`.
Family = Literal["baseline", "training-free", "medusa", "eagle", "parallel", "pipeline"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: the `--method` name.
        summary: one line for help texts and docs.
        family: which builder of `jaxspec.methods` makes it (methods of one family share a drafter module).
        options: the `MethodOptions` fields it takes (`--mesh` always applies); any other option given is refused.
        checkpoint: learned methods: the drafter family whose checkpoints it reads and `jaxspec train` trains
            (`method:` of a training config); None for training-free methods.
        config: learned methods: "module:Class" of the drafter's config dataclass, read from a checkpoint's JSON.
        config_defaults: settings this method fixes in that config (JetSpec's tree-causal attention).
        auto: what `--budget auto` sizes (see AutoKind); None: it has no automatic sizing.
        chain_budget: `--budget` is a chain length capped at the head's block size (dflash).
        default_draft_tokens: K when --num-draft-tokens is not given (training-free methods).
        refusal_hint: appended when an option it does not take is given.
    """

    name: str
    summary: str
    family: Family
    options: frozenset[str] = frozenset()
    checkpoint: str | None = None
    config: str | None = None
    config_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    auto: AutoKind = None
    chain_budget: bool = False
    default_draft_tokens: int | None = None
    refusal_hint: str = ""

    def __post_init__(self):
        unknown = set(self.options) - set(OPTION_FLAGS)
        if unknown:
            raise ValueError(f"{self.name}: unknown option fields {sorted(unknown)}")
        if (self.checkpoint is None) != (self.config is None):
            raise ValueError(f"{self.name}: a learned method names both its checkpoint family and its config class")

    @property
    def learned(self) -> bool:
        """Whether it drafts with trained parameters (a drafter checkpoint)."""
        return self.checkpoint is not None

    @property
    def pipeline(self) -> bool:
        """Whether it decodes with the pipeline loop (jaxspec.pipeline) instead of the speculative loop."""
        return self.family == "pipeline"

    def config_class(self) -> type:
        """The drafter's config dataclass (imported on first use)."""
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(module), cls)

    def flags(self) -> list[str]:
        """The command-line flags it takes, in OPTION_FLAGS order."""
        return [flag for field, flag in OPTION_FLAGS.items() if field in self.options]


_TREE_BY_HAND = frozenset({"num_draft_tokens", "tree_width", "tree_nodes", "lookup_tokens"})

METHOD_SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(name="autoregressive", summary="plain decoding, one target forward per token (the baseline)",
               family="baseline"),
    MethodSpec(name="draft-model", summary="a smaller model with the target's tokenizer drafts a chain or a tree",
               family="training-free", options=frozenset({"draft_model", "num_draft_tokens", "tree_width", "budget"}),
               default_draft_tokens=4, auto="chain"),
    MethodSpec(name="prompt-lookup", summary="copies the continuation of the last n-gram found earlier in the text",
               family="training-free", options=frozenset({"num_draft_tokens", "ngram"}), default_draft_tokens=4,
               refusal_hint="prompt lookup copies one continuation"),
    MethodSpec(name="early-exit", summary="the target's first layers and its LM head draft (self-speculation)",
               family="training-free", options=frozenset({"num_draft_tokens", "tree_width", "exit_layer"}),
               default_draft_tokens=3),
    MethodSpec(name="medusa", summary="extra LM heads on the last hidden state draft a fixed tree",
               family="medusa", options=frozenset({"drafter"}), checkpoint="medusa",
               config="jaxspec.drafters.medusa:MedusaConfig",
               refusal_hint="Medusa drafts the fixed tree of its drafter.choices"),
    MethodSpec(name="eagle", summary="EAGLE-1: a one-layer head on the top feature, a static tree",
               family="eagle", options=frozenset({"drafter"}), checkpoint="eagle",
               config="jaxspec.drafters.eagle:Eagle3Config",
               refusal_hint="the eagle method drafts EAGLE-1's static tree (drafter.tree_choices); for tree options "
                            "use --method eagle2 (the same head with dynamic trees)"),
    MethodSpec(name="eagle2", summary="EAGLE-2: the EAGLE-1 head with dynamic trees",
               family="eagle", options=_TREE_BY_HAND | {"drafter", "budget"}, checkpoint="eagle",
               config="jaxspec.drafters.eagle:Eagle3Config", auto="tree"),
    MethodSpec(name="eagle3", summary="EAGLE-3: low/mid/high features fused, a reduced draft vocabulary, dynamic trees",
               family="eagle", options=_TREE_BY_HAND | {"drafter", "budget"}, checkpoint="eagle3",
               config="jaxspec.drafters.eagle:Eagle3Config", auto="tree"),
    MethodSpec(name="dflash", summary="DFlash: a block head drafts a whole chain in one forward",
               family="parallel", options=frozenset({"drafter", "budget"}), checkpoint="dflash",
               config="jaxspec.drafters.block_head:ParallelHeadConfig",
               config_defaults={"attention": "bidirectional"}, auto="budget", chain_budget=True,
               refusal_hint="dflash drafts a chain; for trees from the same head use --method ddtree"),
    MethodSpec(name="ddtree", summary="DDTree: best-first trees from the DFlash block head's marginals",
               family="parallel", options=frozenset({"drafter", "budget", "tree_width"}), checkpoint="dflash",
               config="jaxspec.drafters.block_head:ParallelHeadConfig",
               config_defaults={"attention": "bidirectional"}, auto="budget"),
    MethodSpec(name="jetspec", summary="JetSpec: a tree-causal parallel head, best-first trees under a budget",
               family="parallel", options=frozenset({"drafter", "budget", "tree_width", "refresh_steps"}),
               checkpoint="jetspec", config="jaxspec.drafters.block_head:ParallelHeadConfig",
               config_defaults={"attention": "tree_causal"}, auto="budget"),
    MethodSpec(name="ppsd", summary="PPSD: the target's stages pipelined, its first stage's early exit drafts",
               family="pipeline", options=frozenset({"tree_width", "num_stages", "stage_devices"}),
               refusal_hint="a pipeline drafts one token per step, with --tree-width W - 1 siblings (docs/spd.md)"),
    MethodSpec(name="spd", summary="SPD: the target's stages pipelined, a trained input-state drafter",
               family="pipeline", options=frozenset({"drafter", "tree_width", "num_stages", "stage_devices"}),
               checkpoint="spd", config="jaxspec.drafters.spd:SPDConfig",
               refusal_hint="a pipeline drafts one token per step, with --tree-width W - 1 siblings (docs/spd.md)"),
)}


def method_spec(name: str) -> MethodSpec:
    """The registry entry of `name`; an unknown name is refused with the list of methods."""
    spec = METHOD_SPECS.get(name)
    if spec is None:
        raise UserError(f"Unknown method '{name}'; choose one of {', '.join(METHOD_SPECS)}.")
    return spec


def method_names(*, learned: bool | None = None) -> tuple[str, ...]:
    """Method names in registry order, optionally only the learned (or only the training-free) ones."""
    return tuple(s.name for s in METHOD_SPECS.values() if learned is None or s.learned == learned)
