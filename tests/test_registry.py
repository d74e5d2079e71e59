"""Registry-driven tests: every method in `jaxspec.registry` is checked here without being named, so a new entry is
covered the moment it is added. Its options are refused by name when it does not take them; its learned drafter
family is trainable and its config class reads an empty config; built from the registry on a tiny target, its greedy
output equals autoregressive decoding at batch 1 and at batch 3 with prompts of different lengths, on a Llama, a
Gemma 3 and a hybrid Qwen3.5 target (which refuses early exit by name; its pipelines keep a ring of recurrent states).
The two mixture-of-experts targets (Qwen3-MoE, Qwen3.5-MoE) run one tree method and one chain method: a method sees
the target only through its forward, and the experts' two paths (gathered for a decoding step, grouped for a
verification of many tokens) are proved equal, and each architecture's tree verification equal to separate
branches, in tests/test_model.py (every method on them took 4.6 minutes of one test worker)."""

import dataclasses

import jax
import pytest
from conftest import fixture_path

from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.methods import MethodOptions, build_method, check_method_options
from jaxspec.registry import METHOD_SPECS, OPTION_FLAGS

# a value that differs from the default for every option field (the refusal test sets one at a time)
_NON_DEFAULT = {"draft_model": "some-model", "num_draft_tokens": 2, "tree_width": 2, "tree_nodes": 4,
                "lookup_tokens": 3, "ngram": 2, "exit_layer": 1, "drafter": "untrained", "budget": 8,
                "refresh_steps": 1, "num_stages": 3, "stage_devices": 2}


def test_every_option_field_has_a_flag_and_a_non_default_test_value():
    fields = {f.name for f in dataclasses.fields(MethodOptions)} - {"mesh"}
    assert set(OPTION_FLAGS) == fields == set(_NON_DEFAULT)
    for field, value in _NON_DEFAULT.items():
        assert value != MethodOptions.__dataclass_fields__[field].default


def test_the_cli_offers_every_method_and_every_flag():
    from jaxspec.cli import build_parser

    parser = build_parser()
    generate_parser = parser._subparsers._group_actions[0].choices["generate"]
    flags = {s for a in generate_parser._actions for s in a.option_strings}
    assert set(OPTION_FLAGS.values()) <= flags
    method_action = next(a for a in generate_parser._actions if "--method" in a.option_strings)
    assert tuple(method_action.choices) == tuple(METHOD_SPECS)


@pytest.mark.parametrize("name", list(METHOD_SPECS))
def test_options_a_method_does_not_take_are_refused_by_name(name):
    spec = METHOD_SPECS[name]
    for field, flag in OPTION_FLAGS.items():
        if field in spec.options:
            continue
        with pytest.raises(UserError, match=f"{flag} does not apply to {name}"):
            check_method_options(name, MethodOptions(**{field: _NON_DEFAULT[field]}))


@pytest.mark.parametrize("name", [n for n, s in METHOD_SPECS.items() if s.learned])
def test_learned_families_are_trainable_and_their_configs_read_defaults(name):
    from jaxspec.methods import _method_config
    from jaxspec.training.distill import trainable_for

    spec = METHOD_SPECS[name]
    trainable = trainable_for(spec.checkpoint)
    config = _method_config(name, {})
    assert isinstance(config, spec.config_class())
    assert hasattr(config, "make_drafter") and hasattr(config, "init_params")
    assert trainable.config_cls is spec.config_class()


def _options(spec) -> MethodOptions:
    """The options a user gives the method on a tiny target: an untrained drafter for learned methods, the tiny
    Qwen2 (same vocabulary) as the draft model, 3 stages for the 3-layer target's pipelines, a block head's budget."""
    options = {}
    if spec.learned:
        options["drafter"] = "untrained"
    if spec.auto == "budget":  # a budget by hand: --budget auto (the default) is tested in test_parallel.py
        options["budget"] = 8
    if spec.auto == "chain":  # a chain by hand: --budget auto (the default) is tested in test_speculative.py
        options["num_draft_tokens"] = spec.default_draft_tokens
    if "draft_model" in spec.options:
        options["draft_model"] = fixture_path("tiny-qwen2")
    if spec.pipeline:
        options["num_stages"] = 3
    return MethodOptions(**options)


@pytest.fixture(scope="module")
def target(request):
    """The tiny target named by the test's parameter: Llama-3, Gemma 3 (a sliding window of 8 positions: drafts and
    trees cross it), Qwen3-MoE (8 experts, 2 per token), Qwen3.5-MoE, or Qwen3.5 (two Gated DeltaNet layers and one
    attention layer: trees whose siblings take different recurrent states, rounds that reject mid-tree)."""
    import numpy as np

    from jaxspec import load_model

    name = request.param
    model = load_model(fixture_path(f"tiny-{name}"))
    _hand_made_cost_model(model)
    yield name, model, np.load(fixture_path(f"tiny_{name}_reference.npz"))
    jax.clear_caches()  # a dozen loops per target: release their programs' memory maps (see conftest.py)


def _hand_made_cost_model(model) -> None:
    """Writes a cost model for `model` where --budget auto looks for one (the run's fresh jaxspec cache folder), so
    the dynamic-tree methods, built with their defaults, size their trees from it instead of timing 16 verification
    shapes per tiny target (a minute each; measuring is tested in test_budget.py). Verification nearly free of its
    width, as on an accelerator: auto picks trees with siblings, which these greedy checks should cross, and the
    same tree on every run instead of one that follows the host's speed."""
    from jaxspec.budget import DEFAULT_CONTEXT, EAGLE_TOKEN_COUNTS, CostModel, cost_model_path, device_name

    batch_sizes = (1, 3)  # the batch sizes generated below
    seconds = [[0.01 * b * (1 + 0.01 * (t - 1)) for t in EAGLE_TOKEN_COUNTS] for b in batch_sizes]
    CostModel(device=device_name(model.weights.embed.dtype), model=model.fingerprint(), batch_sizes=list(batch_sizes),
              token_counts=list(EAGLE_TOKEN_COUNTS), seconds=seconds, context=DEFAULT_CONTEXT).save(
        cost_model_path(model))


EVERY_METHOD_TARGETS = ("llama3", "gemma3", "qwen3_5")
MOE_TARGETS = ("qwen3moe", "qwen3_5_moe")
MOE_METHODS = ("eagle3", "prompt-lookup")  # a tree of the target's features, a chain: the experts' two paths
SPECULATIVE = [n for n in METHOD_SPECS if n != "autoregressive"]
TARGET_METHODS = [(t, n) for t in EVERY_METHOD_TARGETS for n in SPECULATIVE] + [
    (t, n) for t in MOE_TARGETS for n in MOE_METHODS]


@pytest.mark.parametrize(("target", "name"), TARGET_METHODS, indirect=["target"],
                         ids=[f"{t}-{n}" for t, n in TARGET_METHODS])
def test_every_method_from_the_registry_is_greedy_exact_at_batch_1_and_3(target, name):
    _, model, ref = target
    ids = ref["input_ids"]
    prompts = [ids[0, :5].tolist(), ids[1, :17].tolist(), ids[0, 3:40].tolist()]
    if model.config.is_hybrid and name == "early-exit":
        with pytest.raises(UserError, match="does not do yet for a hybrid model"):
            build_method(name, model, _options(METHOD_SPECS[name]))
        return
    method = build_method(name, model, _options(METHOD_SPECS[name]))
    assert method.spec is METHOD_SPECS[name]
    for batch in (prompts[:1], prompts):
        expected = generate(model.weights, model.config, batch, max_new_tokens=12, eos_ids=()).token_ids
        assert method.generate(batch, max_new_tokens=12, eos_ids=()).token_ids == expected, name
