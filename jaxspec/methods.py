"""Method names -> ready methods, so the CLI, the benchmark, the notebooks and the tests build methods one way.

What each method is (its family, drafter checkpoint, options, automatic sizing) is its entry in
`jaxspec.registry`; this module holds one builder per family. `autoregressive` is the baseline (no drafter); every
other method is a drafter on the one speculative decoding loop, or (ppsd, spd) on the pipeline loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import numpy as np

from jaxspec.errors import UserError
from jaxspec.generate import GenerationResult, generate
from jaxspec.loading import LoadedModel, load_model
from jaxspec.registry import METHOD_SPECS, OPTION_FLAGS, MethodSpec, method_names, method_spec
from jaxspec.sampling import GREEDY, SamplingConfig
from jaxspec.speculative import SpeculativeResult, speculative_generate

METHODS = tuple(METHOD_SPECS)  # every --method name, in registry order
LEARNED_METHODS = method_names(learned=True)  # those that read a drafter checkpoint
# --budget auto chooses among these (jaxspec.budget): small ones for a CPU, where a verified node costs time, wide
# ones for an accelerator, where it is nearly free
AUTO_BUDGETS = (2, 4, 8, 16, 32, 64)
BUDGET_TOKEN_COUNTS = (1, *(b + 1 for b in AUTO_BUDGETS))  # the verification sizes their cost model times
SHIPPED_DRAFTERS = os.path.join(os.path.dirname(__file__), "drafters", "shipped")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodOptions:
    """Method settings; None means the method's default for the target."""

    draft_model: str | None = None  # draft-model: a known name, .gguf or HF folder
    num_draft_tokens: int | None = None  # K, the draft depth per round (eagle2/eagle3: the tree depth)
    tree_width: int | None = None  # W top-k siblings per depth (draft-model, early-exit: T = K * W nodes, default 1);
    # eagle2/eagle3: top_k, the children per expanded node
    tree_nodes: int | None = None  # eagle2/eagle3: N, the drafted nodes verified per round
    lookup_tokens: int | None = None  # eagle2/eagle3: a prompt-lookup chain of this many tokens merged into the tree
    ngram: int = 3  # prompt-lookup: longest n-gram matched
    exit_layer: int | None = None  # early-exit: layers used to draft
    drafter: str | None = None  # learned methods: a drafter checkpoint folder, or "untrained"
    # ddtree/jetspec: B drafted nodes per round, dflash: its chain length, or "auto" (the default on one device)
    budget: int | str | None = None
    refresh_steps: int | None = None  # jetspec: tree-causal re-scoring forwards per round
    num_stages: int | None = None  # ppsd/spd: pipeline stages (default: spd the drafter's, ppsd 5 or a divisor)
    stage_devices: int = 1  # ppsd/spd: devices the stages are laid out on (1: emulated on one device)
    mesh: str | None = None  # "data=4,model=2": run on a (data, model) device mesh (jaxspec.sharding); None: one device

    @property
    def tree_by_hand(self) -> bool:
        """Whether the user gave the tree by hand (--num-draft-tokens, --tree-width, --tree-nodes, --lookup-tokens)."""
        return (self.num_draft_tokens, self.tree_width, self.tree_nodes, self.lookup_tokens) != (None,) * 4


def _given(options: MethodOptions, field: str) -> bool:
    """Whether option `field` differs from its default (was given)."""
    return getattr(options, field) != MethodOptions.__dataclass_fields__[field].default


@dataclasses.dataclass
class Method:
    """A ready method: `drafter` is None for autoregressive decoding."""

    name: str  # the registry name (jaxspec bench may add a label, e.g. eagle3[auto])
    drafter: Any
    params: Any
    target: LoadedModel
    spec: MethodSpec | None = None  # its registry entry
    cost_model: Any = None  # --budget auto: the device's verification cost model (jaxspec.budget.CostModel)
    # and the one of rounds at a temperature (tokens drawn with Gumbel noise: dearer per verified row), measured on
    # the first sampled run that needs it (`_cost_model_at`)
    sampled_cost_model: Any = None
    # eagle2/eagle3 with --budget auto (their default): the head's measured draft ranks along text the target
    # generated, int[P, D] (jaxspec.drafters.eagle.draft_ranks), from which each tree shape's tau follows
    tree_ranks: Any = None
    # and how many tokens of a prompt-lookup chain the target keeps at the same positions, int[P], and how many of
    # them are valid, int[P] (jaxspec.drafters.prompt_lookup.lookup_statistics), for the shapes that merge one in
    lookup_runs: Any = None
    lookup_valid: Any = None
    # and at T > 0: the target's probability of the head's top-k candidates at those positions and depths, float[P, D,
    # K] (jaxspec.drafters.eagle.draft_statistics), along answers the target sampled
    draft_mass: Any = None
    # and along those sampled answers, the head's ranks and the prompt-lookup chain's runs (jaxspec.budget.SampledText),
    # for the shapes that merge a chain at T > 0
    sampled_text: Any = None
    # dflash/ddtree/jetspec with --budget auto: tokens per round the head gives at each budget, {budget: tau},
    # measured by decoding the calibration prompts (`measured_budget_taus`)
    budget_taus: dict[int, float] | None = None
    # the device mesh: a (data, model) mesh for every method given --mesh; for ppsd/spd the 'stage' mesh of
    # --stage-devices. None: one device.
    mesh: Any = None

    @property
    def is_pipeline(self) -> bool:
        from jaxspec.pipeline import PipelineDrafter

        return isinstance(self.drafter, PipelineDrafter)

    def drafter_for_batch(self, batch: int, greedy: bool = True):
        """The drafter used for `batch` rows: with --budget auto, the budget `jaxspec.budget.choose_budget` picks, or
        for the EAGLE trees the shape `jaxspec.budget.choose_tree` picks; None where that is no draft at all (plain
        decoding is expected to be the fastest: `generate` then decodes plainly). greedy: whether the run decodes at
        T=0 (the acceptance model of `auto_tree`)."""
        if self.cost_model is None or self.drafter is None:
            return self.drafter
        if self.tree_ranks is not None:
            shape = self.auto_tree(batch, greedy)[0]
            if shape.plain:
                return None
            if self._drafts_chain:
                return dataclasses.replace(self.drafter, depth=shape.depth)
            return dataclasses.replace(self.drafter, depth=shape.depth, top_k=shape.top_k,
                                       num_nodes=shape.verified_nodes, lookup_depth=shape.lookup)
        budget = self.auto_budget(batch, greedy)[0]
        return None if budget == 0 else dataclasses.replace(self.drafter, budget=budget)

    def _cost_model_at(self, batch: int, token_counts, greedy: bool = True):
        """The cost model of greedy rounds (or with greedy False of sampled ones), measured at this batch size first
        when it was not yet (once per device: batch 1 when the method is built, other batch sizes and the sampled
        model when they are first used)."""
        from jaxspec.budget import load_or_measure_cost_model

        cost = self.cost_model if greedy else self.sampled_cost_model
        if cost is None or batch not in cost.batch_sizes:
            cost = load_or_measure_cost_model(self.target, batch_sizes=(batch,), token_counts=token_counts,
                                              sampled=not greedy)
            if greedy:
                self.cost_model = cost
            else:
                self.sampled_cost_model = cost
        return cost

    @property
    def _drafts_chain(self) -> bool:
        """Whether --budget auto sizes a draft model's chain (`auto_tree` with CHAIN_SHAPES) rather than an EAGLE
        tree."""
        from jaxspec.drafters import DraftModelDrafter

        return isinstance(self.drafter, DraftModelDrafter)

    def auto_tree(self, batch: int, greedy: bool = True):
        """(TreeShape, table) of --budget auto for eagle2/eagle3 at this batch size: the shape with the highest
        expected tokens/s from the device's verification cost model and the head's measured acceptance. Drafting is
        costed from the head's own matrices at the target's seconds per weight (`jaxspec.budget.eagle_draft_seconds`:
        the layer and fusion over the last round's nodes + 1 pairs, the LM head over the draft vocabulary, and each
        further depth's layer and LM head over top_k nodes), a head run in bfloat16 at half that.

        The acceptance model at T=0 comes from the head's ranks along greedy text (and the lookup chain's runs); with
        sampling (greedy False) from the target's probabilities of the head's top-k candidates (`draft_mass`: a
        sampled round keeps one of a node's children with their probability mass), measured at temperature 1, and
        for the shapes with a prompt-lookup chain what merging it adds along the same sampled answers
        (`sampled_text`: a sampled round keeps a deterministic draft exactly when the target draws its token); the
        verification (plain decoding's step too) is then costed on the sampled cost model, whose rows also draw their
        tokens; the head's drafting, the same at any temperature, stays on the greedy one.

        For a draft model the same choice runs over its chains (`jaxspec.budget.CHAIN_SHAPES`), with the ranks and
        the sampled rounds' keep chances of `measured_chain_profile` and its forwards costed by
        `jaxspec.budget.draft_model_seconds`."""
        from jaxspec.budget import CHAIN_TOKEN_COUNTS, EAGLE_TOKEN_COUNTS, choose_tree

        counts = CHAIN_TOKEN_COUNTS if self._drafts_chain else EAGLE_TOKEN_COUNTS
        greedy_cost = self._cost_model_at(batch, counts)
        cost = greedy_cost if greedy else self._cost_model_at(batch, counts, greedy=False)
        if self._drafts_chain:
            from jaxspec.budget import CHAIN_SHAPES

            return choose_tree(cost, batch, self.tree_ranks, self._draft_model_seconds(greedy_cost),
                               shapes=CHAIN_SHAPES, draft_mass=None if greedy else self.draft_mass)
        return choose_tree(cost, batch, self.tree_ranks, self._eagle_draft_seconds(greedy_cost),
                           lookup_runs=self.lookup_runs if greedy else None,
                           draft_mass=None if greedy else self.draft_mass, lookup_valid=self.lookup_valid,
                           sampled_text=None if greedy else self.sampled_text)

    def _target_work(self) -> int:
        """Weights one target forward multiplies per token: its layers, and its LM head (vocabulary x width)."""
        cfg = self.target.config
        return parameter_count(self.target.weights.layers) + cfg.vocab_size * cfg.hidden_size

    def _draft_model_seconds(self, greedy_cost):
        """(rows, shape) -> seconds of a draft model's chain: its layers and LM head, weighed by the bytes its run
        reads per weight (`DraftModelDrafter.execution_params`: bfloat16 on the CPU layout) against the target's."""
        from jaxspec.budget import draft_model_seconds

        draft, draft_cfg = self.params, self.drafter.draft_cfg
        executed = self.drafter.execution_params(draft, self.mesh)
        bytes_ratio = _bytes(executed.layers) / _bytes(draft.layers)
        draft_work = round(bytes_ratio * (parameter_count(draft.layers) + draft_cfg.vocab_size * draft_cfg.hidden_size))
        target_work = self._target_work()

        def draft_seconds(rows: int, shape) -> float:
            return draft_model_seconds(greedy_cost, rows, shape, target_work=target_work, draft_work=draft_work)

        return draft_seconds

    def _eagle_draft_seconds(self, greedy_cost):
        """(rows, shape) -> seconds of an EAGLE head's drafting (`jaxspec.budget.eagle_draft_seconds`)."""
        from jaxspec.budget import eagle_draft_seconds

        head = self.params
        fuse, vocab = int(np.size(head.fc)), int(np.size(head.lm_head))
        # a head whose matrices run in bfloat16 (`feature_major_head`) reads half the bytes a weight of the target's
        # float32 layers does: its weights count by their bytes (drafting reads them from memory)
        executed = self.drafter.execution_params(head, self.mesh)
        bytes_ratio = executed.fc.dtype.itemsize / self.target.weights.embed.dtype.itemsize
        work = dict(target_work=self._target_work(),
                    layer_work=round(bytes_ratio * (parameter_count(head) - fuse - vocab - int(np.size(head.d2t)))),
                    fuse_work=round(bytes_ratio * fuse), vocab_work=round(bytes_ratio * vocab))

        def draft_seconds(rows: int, shape) -> float:
            return eagle_draft_seconds(greedy_cost, rows, shape, **work)

        return draft_seconds

    def auto_table(self, batch: int, greedy: bool = True) -> tuple[str, str, list[dict]]:
        """(what was chosen, the table as text, its rows) of --budget auto at this batch size (greedy: see
        `auto_tree`)."""
        from jaxspec.budget import format_budget_table, format_tree_table

        if self.tree_ranks is not None:
            shape, rows = self.auto_tree(batch, greedy)
            lookup = f" + a prompt-lookup chain of {shape.lookup}" if shape.lookup else ""
            chosen = f"depth {shape.depth}, top_k {shape.top_k}, {shape.num_nodes} nodes{lookup}"
            if self._drafts_chain:
                chosen = f"a chain of {shape.depth} draft tokens"
            if shape.plain:
                chosen = "no draft: plain decoding (no tree is expected to beat it here)"
            return chosen, format_tree_table(rows), [dict(r, shape=dataclasses.asdict(r["shape"])) for r in rows]
        budget, rows = self.auto_budget(batch, greedy)
        chosen = f"budget {budget}" if budget else "no draft: plain decoding (no budget is expected to beat it here)"
        return chosen, format_budget_table(rows), rows

    def auto_budget(self, batch: int, greedy: bool = True) -> tuple[int, list[dict]]:
        """(budget, table) of --budget auto at this batch size: the budget with the highest expected tokens/s from the
        device's cost model (with greedy False the sampled one, `_cost_model_at`) and the head's measured tokens per
        round at each budget (`budget_taus`; greedy, also used for sampled rounds). Drafting is costed on the
        greedy cost model as the head's forwards a round, each reading all of the head's weights (its layer, fusion
        and LM head over the draft vocabulary: 2.8 target layers for the SmolLM2 heads), in proportion to the
        target's layers. Budget 0, plain decoding, is one of the choices (`drafter_for_batch` then returns None)."""
        from jaxspec.budget import choose_budget

        greedy_cost, cfg, drafter = self._cost_model_at(batch, BUDGET_TOKEN_COUNTS), self.target.config, self.drafter
        cost = greedy_cost if greedy else self._cost_model_at(batch, BUDGET_TOKEN_COUNTS, greedy=False)
        budgets = [0] + auto_budgets(drafter, self.spec)
        head_in_layers = parameter_count(self.params) / (parameter_count(self.target.weights.layers) / cfg.num_layers)

        def draft_seconds(rows: int, budget: int) -> float:
            forwards = dataclasses.replace(drafter, budget=budget).draft_cost_layers(cfg)  # one a head forward
            return forwards * head_in_layers / cfg.num_layers * greedy_cost.verify_seconds(rows, budget + 1)

        return choose_budget(cost, batch, budgets=budgets, tau=self.budget_taus, draft_seconds=draft_seconds)

    def generate(self, prompt_ids, *, max_new_tokens: int = 128, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 eos_ids=None, max_cache_length: int | None = None) -> GenerationResult:
        kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids,
                      max_cache_length=max_cache_length)
        t = self.target
        if self.drafter is None:
            return generate(t.weights, t.config, prompt_ids, mesh=self.mesh, **kwargs)
        if self.is_pipeline:
            from jaxspec.pipeline import pipeline_generate

            return pipeline_generate(t.weights, t.config, self.drafter, self.params, prompt_ids, mesh=self.mesh,
                                     **kwargs)
        drafter = self.drafter_for_batch(len(prompt_ids), greedy=sampling.temperature == 0)
        if drafter is None:  # --budget auto chose no draft: plain decoding, one token a step
            return plain_rounds(generate(t.weights, t.config, prompt_ids, mesh=self.mesh, **kwargs))
        return speculative_generate(t.weights, t.config, drafter, self.params, prompt_ids, mesh=self.mesh, **kwargs)


def plain_rounds(result: GenerationResult) -> SpeculativeResult:
    """Plain decoding's result as speculative rounds that draft nothing: after the prefill's token, one round (a
    decoding step) per token, each accepting 0 drafts (tau 1)."""
    return SpeculativeResult(token_ids=result.token_ids, seconds=result.seconds,
                             rounds=[max(len(ids) - 1, 0) for ids in result.token_ids],
                             accepted=[[0] * max(len(ids) - 1, 0) for ids in result.token_ids], num_draft_nodes=0)


def parameter_count(tree) -> int:
    """The number of elements in a pytree of arrays (weights of any layout, stacked or per layer)."""
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(tree)))


def _bytes(tree) -> int:
    """The bytes a pytree of arrays holds."""
    return int(sum(np.size(leaf) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def build_method(name: str, target: LoadedModel, options: MethodOptions = MethodOptions()) -> Method:
    """Builds a method for `target`, refusing settings that cannot work with a clear error.

    With options.mesh ("data=4,model=2") the method runs on that device mesh: the target's weights are split over
    the model axis once here and the drafter's parameters replicated; every method then decodes through the same
    loop, with the target's forwards and the acceptance under shard_map (jaxspec.sharding).
    """
    if options.mesh is None:
        return _build_method(name, target, options)
    if target.config.is_hybrid:
        raise UserError(f"--mesh: a hybrid model with linear-attention layers ({target.config.architecture}) runs on "
                        "one device in jaxspec for now; leave out --mesh.")
    from jaxspec.sharding import check_divisible, make_mesh, parse_mesh, replicate_on_mesh, shard_weights

    if method_spec(name).pipeline and options.stage_devices != 1:
        raise UserError(f"{name}: give either --stage-devices (the stages on devices) or --mesh (rows and tensor "
                        "parallelism, the stages emulated on each device group), not both.")
    mesh = make_mesh(*parse_mesh(options.mesh))
    check_divisible(target.config, None, mesh)  # heads, kv heads, f and vocabulary; the batch when it is known
    method = _build_method(name, target, options)
    target = dataclasses.replace(method.target, weights=shard_weights(method.target.weights, mesh))
    params = method.params
    draft_cfg = getattr(method.drafter, "draft_cfg", None)
    if draft_cfg is not None and _splits(draft_cfg, mesh):  # a draft model is a whole LM: split it like the target
        params = shard_weights(params, mesh)
    return dataclasses.replace(method, target=target, params=replicate_on_mesh(mesh, params), mesh=mesh)


def _splits(cfg, mesh) -> bool:
    """Whether the mesh's model axis divides this model's heads, feed-forward width and vocabulary."""
    from jaxspec.sharding import check_divisible

    try:
        check_divisible(cfg, None, mesh)
    except UserError:
        return False
    return True


def check_method_options(name: str, options: MethodOptions) -> None:
    """Refuses settings that cannot work for method `name` with a clear error; needs no model, so the CLI runs it
    before loading one. (Checks that need the target or the drafter run when the method is built.)

    An option the method's registry entry does not take is refused by name; the family's own rules check the values.
    """
    spec = method_spec(name)
    for field, flag in OPTION_FLAGS.items():
        if field not in spec.options and _given(options, field):
            hint = f" ({spec.refusal_hint})" if spec.refusal_hint else ""
            takes = ", ".join(spec.flags()) or "no method options"
            raise UserError(f"{flag} does not apply to {name}{hint}; {name} takes {takes}.")
    if options.tree_width is not None and options.tree_width < 1:
        raise UserError(f"--tree-width must be at least 1, got {options.tree_width}.")
    if options.num_draft_tokens is not None and options.num_draft_tokens < 1:
        raise UserError(f"--num-draft-tokens must be at least 1, got {options.num_draft_tokens}.")
    if options.lookup_tokens is not None and options.lookup_tokens < 0:
        raise UserError(f"--lookup-tokens must be 0 or more, got {options.lookup_tokens}.")
    if options.stage_devices < 1:
        raise UserError(f"--stage-devices must be at least 1, got {options.stage_devices}.")
    if options.ngram < 1:
        raise UserError(f"--ngram must be at least 1, got {options.ngram}.")
    if name == "draft-model" and options.draft_model is None:
        raise UserError(
            "The draft-model method needs --draft-model (a known name, .gguf file or Hugging Face folder of a smaller "
            "model with the target's tokenizer)."
        )
    if spec.auto in ("tree", "chain"):  # an EAGLE tree or a draft model's chain: auto, or the round by hand
        flags = ("--num-draft-tokens, --tree-width, --tree-nodes, --lookup-tokens" if spec.auto == "tree"
                 else "--num-draft-tokens, --tree-width")
        if options.budget not in (None, "auto"):
            raise UserError(f"{name} takes --budget auto (the default: its {spec.auto} chosen for this device) or its "
                            f"{spec.auto} by hand with {flags}, not a number.")
        if options.budget == "auto" and options.tree_by_hand:
            raise UserError(f"{name}: give either --budget auto or the {spec.auto} by hand ({flags}), not both.")


def _build_method(name: str, target: LoadedModel, options: MethodOptions) -> Method:
    check_method_options(name, options)
    spec = method_spec(name)
    if target.config.is_hybrid and name == "early-exit":
        raise UserError(f"{name} drafts from the first layers alone, which jaxspec does not do yet for a hybrid model "
                        f"with linear-attention layers ({target.config.architecture}); its other methods run on it.")
    method = _BUILDERS[spec.family](spec, target, options)
    method.spec = spec
    return method


def _build_baseline(spec: MethodSpec, target: LoadedModel, options: MethodOptions) -> Method:
    return Method(name=spec.name, drafter=None, params=None, target=target)


_LAST_DRAFT_MODEL: dict[tuple, LoadedModel] = {}  # `_draft_model`: the last one loaded


def _draft_model(name_or_path: str, dtype) -> LoadedModel:
    """The draft model, loaded once for consecutive methods that name the same one (a --num-draft-tokens sweep builds
    one method per K: a copy of Qwen2.5-Coder-0.5B per K, with its CPU layout, ran a 23 GB host out of memory); the
    last one loaded is kept."""
    stamp = os.path.getmtime(name_or_path) if os.path.exists(name_or_path) else None  # a file replaced: loaded anew
    key = (os.path.abspath(name_or_path) if stamp is not None else name_or_path, stamp, str(jax.numpy.dtype(dtype)))
    if key not in _LAST_DRAFT_MODEL:
        _LAST_DRAFT_MODEL.clear()  # the previous draft model's memory goes with its methods
        _LAST_DRAFT_MODEL[key] = load_model(name_or_path, dtype=dtype)
    return _LAST_DRAFT_MODEL[key]


def _sized_automatically(options: MethodOptions, by_hand: bool) -> bool:
    """Whether --budget auto sizes the rounds: given, or the default on one device where the round (tree, chain or
    budget) is not given by hand."""
    return options.budget == "auto" or (options.mesh is None and options.budget is None and not by_hand)


def _build_training_free(spec: MethodSpec, target: LoadedModel, options: MethodOptions) -> Method:
    """draft-model, prompt-lookup, early-exit: chains (or top-W trees) from a model or the text, no training."""
    from jaxspec.drafters import DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter

    k = options.num_draft_tokens if options.num_draft_tokens is not None else spec.default_draft_tokens
    width = 1 if options.tree_width is None else options.tree_width
    if spec.name == "prompt-lookup":
        return Method(name=spec.name, drafter=PromptLookupDrafter(depth=k, max_ngram=options.ngram), params=None,
                      target=target)
    if spec.name == "early-exit":
        layer = options.exit_layer if options.exit_layer is not None else max(1, target.config.num_layers // 4)
        drafter = EarlyExitDrafter(depth=k, tree_width=width, exit_layer=layer)
        drafter.check_compatible(None, target.config)
        return Method(name=spec.name, drafter=drafter, params=None, target=target)
    draft = _draft_model(options.draft_model, target.weights.embed.dtype)
    if draft.config.is_hybrid:
        raise UserError(f"The draft model {options.draft_model} has linear-attention layers "
                        f"({draft.config.architecture}); jaxspec drafts with attention-only models for now.")
    drafter = DraftModelDrafter(depth=k, tree_width=width, draft_cfg=draft.config)
    drafter.check_compatible(draft.weights, target.config, target.tokenizer, draft.tokenizer)
    # --budget auto, the default on one device unless the chain is given by hand: the chain's length from the
    # device's cost model and the draft model's measured acceptance along the target's own answers
    if _sized_automatically(options, options.tree_by_hand):
        from jaxspec.budget import CHAIN_TOKEN_COUNTS, load_or_measure_cost_model

        # batch 1 now; other batch sizes when they are first used (Method.auto_tree)
        cost_model = load_or_measure_cost_model(target, batch_sizes=(1,), token_counts=CHAIN_TOKEN_COUNTS)
        ranks, mass = measured_chain_profile(target, draft)
        return Method(name=spec.name, drafter=drafter, params=draft.weights, target=target, cost_model=cost_model,
                      tree_ranks=ranks, draft_mass=mass)
    return Method(name=spec.name, drafter=drafter, params=draft.weights, target=target)


def _build_learned(spec: MethodSpec, target: LoadedModel, options: MethodOptions) -> Method:
    """Medusa, the EAGLE family and the parallel heads: a trained drafter (or 'untrained'), with --budget auto."""
    name = spec.name
    dynamic_tree = spec.auto == "tree"
    drafter, params = load_learned_drafter(name, target, options.drafter, options)
    if options.lookup_tokens:  # by hand: the head's tree as given (or the drafter's) plus the lookup chain
        drafter = dataclasses.replace(drafter, num_nodes=drafter.num_nodes + options.lookup_tokens,
                                      lookup_depth=options.lookup_tokens)
    cost_model = tree_ranks = lookup_runs = lookup_valid = draft_mass = sampled_text = None
    # --budget auto is the default of every tree method on one device: the EAGLE trees unless given by hand, the
    # block heads' budgets unless given
    auto = _sized_automatically(options, options.tree_by_hand if dynamic_tree else spec.auto != "budget")
    static_tree = getattr(drafter, "choices", None) is not None  # a checkpoint with a fixed EAGLE-1 tree
    if dynamic_tree and options.budget == "auto" and static_tree:
        raise UserError(f"This {name} drafter drafts a fixed tree (its drafter.tree_choices); --budget auto sizes "
                        "dynamic trees only.")
    if auto and dynamic_tree and not static_tree:
        from jaxspec.budget import EAGLE_TOKEN_COUNTS, load_or_measure_cost_model

        # batch 1 now; other batch sizes when they are first used (Method.auto_tree)
        cost_model = load_or_measure_cost_model(target, batch_sizes=(1,), token_counts=EAGLE_TOKEN_COUNTS)
        folder = options.drafter if options.drafter != "untrained" else None
        folder = shipped_drafter(name, target) if folder is None and options.drafter is None else folder
        tree_ranks, lookup_runs, lookup_valid, draft_mass, sampled_text = measured_draft_ranks(target, drafter, params,
                                                                                               folder)
    budget_taus = None
    if auto and spec.auto == "budget":
        from jaxspec.budget import load_or_measure_cost_model

        # every auto budget + 1 (the root); batch 1 now, other batch sizes when they are first used (auto_budget)
        cost_model = load_or_measure_cost_model(target, batch_sizes=(1,), token_counts=BUDGET_TOKEN_COUNTS)
        folder = options.drafter if options.drafter != "untrained" else None
        budget_taus = measured_budget_taus(target, drafter, params, auto_budgets(drafter, spec), folder)
    return Method(name=name, drafter=drafter, params=params, target=target, cost_model=cost_model,
                  tree_ranks=tree_ranks, lookup_runs=lookup_runs, lookup_valid=lookup_valid, draft_mass=draft_mass,
                  sampled_text=sampled_text, budget_taus=budget_taus)


def auto_budgets(drafter, spec: MethodSpec) -> list[int]:
    """The budgets --budget auto chooses among for a block-head drafter: AUTO_BUDGETS, for DFlash's chain capped at
    the head's block size."""
    if spec.chain_budget:
        return sorted({min(b, drafter.block_size) for b in AUTO_BUDGETS})
    return list(AUTO_BUDGETS)


def _build_pipeline(spec: MethodSpec, target: LoadedModel, options: MethodOptions) -> Method:
    """PPSD (training-free early exit) or SPD (a trained pipeline drafter) with --num-stages on --stage-devices."""
    from jaxspec.drafters.ppsd import EarlyExitPipelineDrafter
    from jaxspec.pipeline import check_pipeline, stage_mesh
    from jaxspec.sharding import replicate_on_mesh

    name = spec.name

    width = 1 if options.tree_width is None else options.tree_width
    cfg = target.config
    if name == "ppsd":
        n = options.num_stages
        if n is None:  # 5 when it divides the layers, else the smallest divisor >= 2
            divisors = [d for d in range(2, cfg.num_layers + 1) if cfg.num_layers % d == 0]
            n = 5 if 5 in divisors else min(divisors)
        drafter, params = EarlyExitPipelineDrafter(num_stages=n, tree_width=width), None
    else:
        drafter, params = load_learned_drafter(name, target, options.drafter, options)
        drafter = dataclasses.replace(drafter, tree_width=width)
        if options.num_stages is not None:
            drafter = dataclasses.replace(drafter, num_stages=options.num_stages)
        drafter.check_compatible(params, cfg)
    check_pipeline(cfg, drafter.num_stages, width, options.stage_devices)
    mesh = None
    if options.stage_devices != 1:
        mesh = stage_mesh(drafter.num_stages, options.stage_devices)
        # the weights and the drafter replicated on the mesh once, not at every generation
        weights, params = replicate_on_mesh(mesh, (target.weights, params))
        target = dataclasses.replace(target, weights=weights)
    return Method(name=name, drafter=drafter, params=params, target=target, mesh=mesh)


def _method_config(method: str, config: dict):
    """The drafter config dataclass of a learned method from a checkpoint's settings (the method's fixed settings
    first, the checkpoint's over them)."""
    from jaxspec.config_files import from_dict

    spec = method_spec(method)
    if not spec.learned:
        raise UserError(f"Method '{method}' has no learned drafter.")
    return from_dict(spec.config_class(), {**spec.config_defaults, **config}, path="drafter")


_BUILDERS = {"baseline": _build_baseline, "training-free": _build_training_free, "medusa": _build_learned,
             "eagle": _build_learned, "parallel": _build_learned, "pipeline": _build_pipeline}


def shipped_drafter(method: str, target: LoadedModel) -> str | None:
    """The drafter folder shipped inside the package for `method` and this exact target, if there is one."""
    from jaxspec.checkpoint import read_drafter_meta

    if not os.path.isdir(SHIPPED_DRAFTERS):
        return None
    fingerprint = target.fingerprint()
    for entry in sorted(os.listdir(SHIPPED_DRAFTERS)):
        path = os.path.join(SHIPPED_DRAFTERS, entry)
        if not os.path.isdir(path):
            continue
        meta = read_drafter_meta(path)
        if meta["method"] == method_spec(method).checkpoint and meta["target"].get("fingerprint") == fingerprint:
            return path
    return None


def _tree_settings(method: str, cfg, options: MethodOptions):
    """The EAGLE config with the method's tree: `eagle` a static tree (the checkpoint's or the default), `eagle2` and
    `eagle3` a dynamic tree with --num-draft-tokens (depth), --tree-width (top_k) and --tree-nodes overriding it."""
    from jaxspec.drafters.eagle import DEFAULT_STATIC_TREE

    if method == "eagle":  # tree options were refused by check_method_options
        return dataclasses.replace(cfg, tree_choices=cfg.tree_choices or DEFAULT_STATIC_TREE)
    overrides = {"tree_choices": None}
    for field, value in (("depth", options.num_draft_tokens), ("top_k", options.tree_width),
                         ("num_nodes", options.tree_nodes)):
        if value is not None:
            overrides[field] = value
    if "num_nodes" not in overrides and ("depth" in overrides or "top_k" in overrides):
        depth, top_k = overrides.get("depth", cfg.depth), overrides.get("top_k", cfg.top_k)
        overrides["num_nodes"] = min(cfg.num_nodes, top_k + (depth - 1) * top_k ** 2)
    return dataclasses.replace(cfg, **overrides)


def _parallel_drafter(method: str, cfg, options: MethodOptions):
    """The DFlash / DDTree / JetSpec drafter of a head config with --budget, --tree-width and --refresh-steps (which
    of them the method takes was checked by check_method_options)."""
    overrides = {}
    budget = options.budget
    if budget is not None and budget != "auto":
        if not isinstance(budget, int) or budget < 1:
            raise UserError(f"--budget must be a positive integer or 'auto', got {budget!r}.")
        overrides["budget"] = budget
    if budget == "auto":
        overrides["budget"] = 16  # a placeholder: Method.generate picks the budget per batch size
    if options.tree_width is not None:
        overrides["tree_width"] = options.tree_width
    if options.refresh_steps is not None:
        overrides["refresh_steps"] = options.refresh_steps
    if method_spec(method).chain_budget and isinstance(budget, int) and budget > cfg.block_size:
        raise UserError(f"dflash drafts at most its block size ({cfg.block_size}) tokens per round; --budget {budget} "
                        "is more. Use ddtree or jetspec for larger budgets.")
    return dataclasses.replace(cfg, **overrides).make_drafter(method)


def load_learned_drafter(method: str, target: LoadedModel, path: str | None,
                         options: MethodOptions = MethodOptions()):
    """(drafter, params) from a drafter checkpoint trained for `target`, or freshly initialised for "untrained".

    path: a folder written by `jaxspec train`; for eagle3 also a Hugging Face EAGLE-3 folder (config.json +
    safetensors, as vLLM and SGLang load); "untrained"; or None: the drafter shipped with jaxspec for this target.
    """
    spec = method_spec(method)
    if not spec.learned:
        raise UserError(f"Method '{method}' has no learned drafter.")
    check_method_options(method, options)
    if path is None:
        path = shipped_drafter(method, target)
        if path is None:
            raise UserError(
                f"The {method} method needs --drafter: a drafter folder written by `jaxspec train`"
                + (", a Hugging Face EAGLE-3 folder" if method == "eagle3" else "")
                + ", or 'untrained' for freshly initialised weights (a baseline that shows what training adds). "
                f"jaxspec ships no {spec.checkpoint} drafter for {target.source}."
                + (" Train one with `jaxspec train --config configs/spd-smollm2-135m.yaml` (its target and data "
                   "adapted), or use --method ppsd, which drafts with the target's own first stage and needs no "
                   "drafter." if method == "spd" else "")
            )
    eagle, parallel = spec.family == "eagle", spec.family == "parallel"
    if path == "untrained":
        if spec.checkpoint == "eagle":  # the EAGLE-1 head (eagle, eagle2)
            from jaxspec.drafters.eagle import eagle1_config

            cfg = eagle1_config(target.config)
        else:
            cfg = _method_config(method, {})
        cfg = cfg.for_target(target.config) if hasattr(cfg, "for_target") else cfg  # target-dependent defaults
        if eagle:
            cfg = _tree_settings(method, cfg, options)
        if parallel:
            return _parallel_drafter(method, cfg, options), cfg.init_params(target.config, target.weights)
        return cfg.make_drafter(), cfg.init_params(target.config, target.weights)
    from jaxspec.checkpoint import DRAFTER_META_FILE, load_drafter, read_drafter_meta

    if (eagle and os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.isfile(os.path.join(path, DRAFTER_META_FILE))):
        if spec.checkpoint != "eagle3":
            raise UserError(f"{path} is a Hugging Face drafter folder; jaxspec reads EAGLE-3 ones there: use "
                            "--method eagle3.")
        from jaxspec.drafters.eagle_hf import import_eagle3_hf

        params, cfg = import_eagle3_hf(path, target.config, target.weights, target_fingerprint=target.fingerprint())
        cfg = _tree_settings(method, cfg.for_target(target.config), options)
        drafter = cfg.make_drafter()
        drafter.check_compatible(params, target.config)
        return drafter, params
    if spec.checkpoint == "medusa" and not os.path.isfile(os.path.join(path, DRAFTER_META_FILE)):
        from jaxspec.drafters.medusa_hf import import_medusa_hf, is_medusa_folder

        if is_medusa_folder(path):  # the Medusa repository's layout
            params, cfg = import_medusa_hf(path, target.config, target.weights)
            return cfg.make_drafter(), params
    meta = read_drafter_meta(path)
    cfg = _method_config(method, meta.get("config", {}))
    cfg = cfg.for_target(target.config) if hasattr(cfg, "for_target") else cfg
    abstract = cfg.init_params(target.config, target.weights)
    _, params = load_drafter(path, expected_method=spec.checkpoint, target_fingerprint=target.fingerprint(),
                             target_source=target.source, abstract_params=abstract)
    if eagle:
        cfg = _tree_settings(method, cfg, options)
    if parallel:
        drafter = _parallel_drafter(method, cfg, options)
        drafter.check_compatible(params, target.config)
        return drafter, params
    return cfg.make_drafter(), params


# Generic chat prompts (none from the evaluation sets) whose answers (greedy, and sampled for T > 0) calibrate the
# acceptance of EAGLE heads.
CALIBRATION_PROMPTS = (
    "Explain how a hash table works and when it is a poor choice.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "A train travels 120 km in 1.5 hours, then 80 km in 1 hour. What is its average speed? Explain.",
    "What are the main causes of inflation, and how do central banks respond?",
    "Give step-by-step instructions for making a simple tomato sauce.",
    "Write a JavaScript function that debounces another function.",
    "Compare renewable and fossil energy sources in a short essay.",
)
CALIBRATION_TOKENS = 96
CALIBRATION_DEPTH = 6  # the deepest tree shape measured (jaxspec.budget.TREE_SHAPES)
CALIBRATION_LOOKUP = 12  # the longest prompt-lookup chain measured (its runs are capped there; TREE_SHAPES' longest)
CALIBRATION_NGRAM = 3  # the lookup's longest n-gram (Eagle3Drafter.lookup_ngram's default)
CALIBRATION_TOP_K = 4  # the widest level whose target probability mass is measured (sampled rounds)
# the masses are measured along answers sampled at this temperature and seed: the text a sampled round sees (along
# greedy text the head's deeper candidates looked far likelier than sampled rounds found them: a chain of 2 was
# expected at tau 1.51 at T=1 and ran 1.25-1.47)
CALIBRATION_TEMPERATURE = 1.0
CALIBRATION_SEED = 0


DRAFT_RANKS_FILE = "draft-ranks.npz"  # in a drafter folder: its measured ranks (see `save_draft_ranks`)


def _calibration_digest() -> str:
    """What the measured ranks depend on besides the head and the target: the prompts, tokens and depth."""
    import hashlib

    text = json.dumps([CALIBRATION_PROMPTS, CALIBRATION_TOKENS, CALIBRATION_DEPTH, CALIBRATION_LOOKUP,
                       CALIBRATION_NGRAM, CALIBRATION_TOP_K, CALIBRATION_TEMPERATURE, CALIBRATION_SEED])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measured_draft_ranks(target: LoadedModel, drafter, params,
                         folder: str | None = None) -> tuple[Any, Any, Any, Any, Any]:
    """(ranks int[P, CALIBRATION_DEPTH], lookup runs int[P], lookup valid int[P], mass float[P', CALIBRATION_DEPTH,
    CALIBRATION_TOP_K], sampled text `jaxspec.budget.SampledText`): an
    EAGLE head's ranks of the target's tokens along the target's own greedy answers to CALIBRATION_PROMPTS (what
    rounds keep at T=0), how many tokens of a prompt-lookup chain the target keeps at the same positions at T=0
    and how many of them are valid (`jaxspec.drafters.prompt_lookup.lookup_statistics`); the target's probabilities
    of the head's top-k candidates along answers it sampled at CALIBRATION_TEMPERATURE (what rounds keep at T > 0;
    `jaxspec.drafters.eagle.draft_statistics`), and at those P' positions the head's ranks and the lookup chain's
    runs and valid counts (what a chain merged in adds at T > 0).

    Read from the drafter's folder when it holds them for this head and target (`save_draft_ranks`; the shipped
    drafter does), else from $JAXSPEC_CACHE_DIR per head and target, else measured (a greedy generation of the
    calibration prompts and one teacher-forced pass of the head) and cached there."""

    from jaxspec.budget import cache_folder

    head = _head_digest(target, params)
    stored = os.path.join(folder, DRAFT_RANKS_FILE) if folder else None
    if stored and os.path.isfile(stored):
        try:
            with np.load(stored) as f:
                same = (str(f["target"]) == target.fingerprint() and str(f["calibration"]) == _calibration_digest()
                        and str(f["head"]) == head)
                if same and f["ranks"].ndim == 2 and f["ranks"].shape[1] == CALIBRATION_DEPTH:
                    return _stored_profile(f)
        except (OSError, ValueError, KeyError):
            pass  # unreadable, or of another head or target (a retrained head in the same folder): measured below
    path = os.path.join(cache_folder(), f"draft-ranks-{head}-{_calibration_digest()}.npz")
    if os.path.isfile(path):
        try:
            with np.load(path) as f:
                return _stored_profile(f)
        except (OSError, ValueError, KeyError):
            pass
    profile = _measure_draft_ranks(target, drafter, params)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **_profile_arrays(*profile))
    return profile


def _profile_arrays(ranks, runs, valid, mass, sampled) -> dict[str, np.ndarray]:
    """The arrays of a draft-ranks file (`measured_draft_ranks`'s five results) by name."""
    return dict(ranks=ranks, lookup_runs=runs, lookup_valid=valid, draft_mass=mass, sampled_ranks=sampled.ranks,
                sampled_lookup_runs=sampled.lookup_runs, sampled_lookup_valid=sampled.lookup_valid)


def _stored_profile(f) -> tuple[Any, Any, Any, Any, Any]:
    """`measured_draft_ranks`'s five results from an open draft-ranks file (KeyError: a file of an older calibration,
    without some of them)."""
    from jaxspec.budget import SampledText

    sampled = SampledText(ranks=f["sampled_ranks"], lookup_runs=f["sampled_lookup_runs"],
                          lookup_valid=f["sampled_lookup_valid"])
    return f["ranks"], f["lookup_runs"], f["lookup_valid"], f["draft_mass"], sampled


def _head_digest(target: LoadedModel, params) -> str:
    """Names a head's parameters together with its target (what measured ranks depend on besides the prompts)."""
    import hashlib

    digest = hashlib.sha256(target.fingerprint().encode())
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def save_draft_ranks(folder: str, target: LoadedModel, drafter, params) -> str:
    """Measures an EAGLE head's ranks on the calibration prompts and stores them in its drafter folder, so that
    --budget auto needs no calibration run on first use. Returns the file's path."""
    path = os.path.join(folder, DRAFT_RANKS_FILE)
    np.savez(path, **_profile_arrays(*_measure_draft_ranks(target, drafter, params)), target=target.fingerprint(),
             calibration=_calibration_digest(), head=_head_digest(target, params))
    return path


def _calibration_prompts(target: LoadedModel) -> list[list[int]]:
    """CALIBRATION_PROMPTS as token ids (chat template applied); a bare checkpoint without a tokenizer gets fixed
    random 16-token prompts instead (the target's own continuations of them are what is measured)."""

    from jaxspec.tokenizer import encode_prompt

    if target.tokenizer is not None:
        return [encode_prompt(target.tokenizer, p) for p in CALIBRATION_PROMPTS]
    rng = np.random.default_rng(0)
    return [rng.integers(1, target.config.vocab_size, 16).tolist() for _ in CALIBRATION_PROMPTS]


def budget_taus_file(drafter) -> str:
    """The file in a drafter folder that holds a block head's measured taus per budget for this kind of drafter
    (`save_budget_taus`; DFlash and DDTree read one head each their own way)."""
    return f"budget-taus-{type(drafter).__name__.lower()}.json"


BUDGET_CALIBRATION_PROMPTS = 4  # the first CALIBRATION_PROMPTS (an explanation, a story, code, arithmetic)
BUDGET_CALIBRATION_TOKENS = 64


def _budget_taus_key(target: LoadedModel, drafter, params, budgets) -> dict:
    """What a block head's measured taus depend on: the head and target, the drafter's settings other than the
    budget (tree width, refresh steps, ...), the budgets and the calibration text."""
    settings = repr(dataclasses.replace(drafter, budget=0))
    key = {"head": _head_digest(target, params), "drafter": settings, "budgets": [int(b) for b in budgets],
           "calibration": [CALIBRATION_PROMPTS[:BUDGET_CALIBRATION_PROMPTS], BUDGET_CALIBRATION_TOKENS]}
    return json.loads(json.dumps(key))  # as read back from a file (tuples as lists)


def measured_budget_taus(target: LoadedModel, drafter, params, budgets, folder: str | None = None) -> dict[int, float]:
    """{budget: tau}: tokens per round (bonus included) a block-head drafter (DFlash, DDTree, JetSpec) gives at each
    budget, from the real decoding loop: greedy answers of BUDGET_CALIBRATION_TOKENS tokens to the first
    BUDGET_CALIBRATION_PROMPTS calibration prompts, one run per budget (each compiles its program: a minute or two
    on a CPU for the whole set).

    Read from the drafter's folder when it holds them for this head, target, settings and budgets
    (`save_budget_taus`), else from $JAXSPEC_CACHE_DIR, else measured and cached there."""
    import hashlib

    from jaxspec.budget import cache_folder
    from jaxspec.data import write_json

    key = _budget_taus_key(target, drafter, params, budgets)
    stored = os.path.join(folder, budget_taus_file(drafter)) if folder else None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_folder(), f"budget-taus-{digest}.json")
    for candidate in (stored, path):
        if candidate and os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    data = json.load(f)
                if data["key"] == key:
                    return {int(b): float(t) for b, t in data["taus"].items()}
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable, or of another head or settings: measured below
    taus = _measure_budget_taus(target, drafter, params, budgets)
    write_json(path, {"key": key, "taus": taus})
    return taus


def save_budget_taus(folder: str, target: LoadedModel, drafter, params, budgets) -> str:
    """Measures a block head's taus at `budgets` and stores them in its drafter folder, so that --budget auto needs
    no calibration run on first use. Returns the file's path."""
    from jaxspec.data import write_json

    path = os.path.join(folder, budget_taus_file(drafter))
    taus = _measure_budget_taus(target, drafter, params, budgets)
    write_json(path, {"key": _budget_taus_key(target, drafter, params, budgets), "taus": taus})
    return path


def _measure_budget_taus(target: LoadedModel, drafter, params, budgets) -> dict[int, float]:
    import sys

    from tqdm import tqdm

    from jaxspec.metrics import tau

    prompts = _calibration_prompts(target)[:BUDGET_CALIBRATION_PROMPTS]
    taus = {}
    for budget in tqdm(budgets, desc="calibrating --budget auto", unit="budget", file=sys.stderr):
        result = speculative_generate(target.weights, target.config, dataclasses.replace(drafter, budget=int(budget)),
                                      params, prompts, max_new_tokens=BUDGET_CALIBRATION_TOKENS)
        taus[int(budget)] = tau(result.accepted)
    return taus


def _calibration_text(target: LoadedModel, sampling: SamplingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int64[R, S], lengths int[R], answer starts int[R]): the calibration prompts followed by the target's
    own answers of up to CALIBRATION_TOKENS tokens, decoded with `sampling` (seed CALIBRATION_SEED)."""
    prompts = _calibration_prompts(target)
    starts = np.array([len(p) for p in prompts])  # [R]
    answers = generate(target.weights, target.config, prompts, max_new_tokens=CALIBRATION_TOKENS,
                       sampling=sampling, seed=CALIBRATION_SEED).token_ids
    lengths = np.array([len(p) + len(a) for p, a in zip(prompts, answers)])  # [R]
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int64)  # [R, S]
    for row, (p, a) in enumerate(zip(prompts, answers)):
        tokens[row, : lengths[row]] = p + a
    return tokens, lengths, starts


def measured_chain_profile(target: LoadedModel, draft: LoadedModel) -> tuple[np.ndarray, np.ndarray]:
    """(ranks int[P, DRAFT_MODEL_DEPTH], mass float[P', DRAFT_MODEL_DEPTH, 1]): a draft model's ranks of the
    target's tokens along the target's own greedy answers to CALIBRATION_PROMPTS (what its chains keep at T=0), and
    along answers the target sampled at CALIBRATION_TEMPERATURE the chance a sampled round keeps each level
    (`jaxspec.drafters.draft_model.chain_statistics`). From $JAXSPEC_CACHE_DIR per target and draft model, else
    measured (two generations of the calibration prompts by the target and teacher-forced forwards of both models,
    about a minute for SmolLM2, a few for a 1.5B target on a CPU) and cached there."""
    import hashlib

    from jaxspec.budget import DRAFT_MODEL_DEPTH, cache_folder
    from jaxspec.drafters.draft_model import chain_statistics

    key = json.dumps([target.fingerprint(), draft.fingerprint(), _calibration_digest(), DRAFT_MODEL_DEPTH])
    path = os.path.join(cache_folder(), f"chain-ranks-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    if os.path.isfile(path):
        try:
            with np.load(path) as f:
                return f["ranks"], f["draft_mass"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable: measured again below

    def statistics(sampling: SamplingConfig, temperature: float | None):
        tokens, lengths, starts = _calibration_text(target, sampling)
        return chain_statistics(draft.weights, draft.config, target.weights, target.config, tokens, lengths, starts,
                                DRAFT_MODEL_DEPTH, temperature)

    print("jaxspec: measuring the draft model's acceptance along the target's answers (once per pair) ...",
          file=sys.stderr, flush=True)
    ranks, _ = statistics(GREEDY, None)  # [P, D]
    _, mass = statistics(SamplingConfig(temperature=CALIBRATION_TEMPERATURE), CALIBRATION_TEMPERATURE)  # [P', D, 1]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, ranks=ranks, draft_mass=mass)
    return ranks, mass


def _measure_draft_ranks(target: LoadedModel, drafter, params):
    from jaxspec.budget import SampledText
    from jaxspec.drafters.eagle import draft_statistics
    from jaxspec.drafters.prompt_lookup import lookup_statistics

    def statistics(tokens, lengths, starts, top_k: int):
        return draft_statistics(params, target.weights, target.config, drafter.target_layers, tokens, lengths,
                                starts, CALIBRATION_DEPTH, top_k, head_cfg=drafter.head_config(target.config))

    def lookup(tokens, lengths, starts):  # (runs, valid) [P] each
        return lookup_statistics(tokens, lengths, starts, CALIBRATION_LOOKUP, CALIBRATION_NGRAM)

    text = _calibration_text(target, GREEDY)  # (tokens [R, S], lengths [R], answer starts [R])
    ranks, _ = statistics(*text, 0)  # [P, D]
    runs, valid = lookup(*text)  # [P] each
    answers = _calibration_text(target, SamplingConfig(temperature=CALIBRATION_TEMPERATURE))  # sampled
    sampled_ranks, mass = statistics(*answers, CALIBRATION_TOP_K)  # [P', D], [P', D, K]
    sampled = SampledText(sampled_ranks, *lookup(*answers))
    return ranks, runs, valid, mass, sampled
