"""At T > 0 every drafter, run through the real decoding loop, emits the target's own distribution.

test_lossless.py proves the acceptance rule exact for q's that the test computes itself. Here nothing is computed
by hand: each drafter makes its own trees and its own q inside `speculative_generate`, for thousands of rows of one
prompt at once, and the joint distribution of the first new tokens is compared with the target's, enumerated
exactly over a vocabulary of 8 (a chi-square test; the seed is fixed, so the test is deterministic). The tiny models
are scaled so that their distributions are far from one-hot and the draft model's differ from the target's: a drafter
that reports a q other than the one it sampled from (an untempered softmax, q without top-k or top-p) moves the output
by several hundredths, which the test detects (`test_a_drafter_reporting_the_wrong_q_is_caught`;
`scripts/mutation_check.py` plants more such bugs and shows that the tests fail on each).

Every method of the registry (`jaxspec.registry`) is checked without being named, built as the CLI builds it (learned
heads untrained), with temperature, top-k and top-p all binding; hand-made drafters add the shapes the defaults
do not reach (a reduced draft vocabulary, sibling trees), and a prompt whose lookup runs out tests padding nodes.
"""

import dataclasses
import functools
import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec import methods
from jaxspec.config import ModelConfig
from jaxspec.drafters import DraftModelDrafter, PromptLookupDrafter
from jaxspec.drafters.prompt_lookup import find_continuation
from jaxspec.loading import LoadedModel
from jaxspec.model import forward, init_weights
from jaxspec.registry import METHOD_SPECS
from jaxspec.sampling import SamplingConfig, target_probs
from jaxspec.speculative import speculative_generate

# thousands of rows through every loop: running them unoptimized costs more than compiling them with XLA's
# optimizations (the file alone 257 -> 223 s; jetspec's and dflash's 16,384 rows 27 -> 16 and 22 -> 14 s)
pytestmark = pytest.mark.optimized

V = 8
CFG = ModelConfig(architecture="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
TARGET = init_weights(CFG, jax.random.key(11), scale=0.5)
DRAFT = init_weights(CFG, jax.random.key(12), scale=0.5)
PROMPT = (1, 3, 0, 2, 1, 3)  # repeats, so prompt lookup finds continuations
# prompt lookup finds only "5" -> "5": one drafted token, then padding nodes (valid False) in the first round
RUNS_OUT = (2, 5, 5)
NEW = 3  # new tokens compared (V ** NEW = 512 sequences)
ROWS = 4096  # samples: rows of one generate call
# the parallel heads sample each depth from a marginal and report it as q: a q that misses the sampling settings
# (the raw marginal) moves the output less than a chain drafter's wrong q does, and 4096 rows gave p-values of
# 0.001-0.1 for it (seeds 0-3); 16384 rows give 1e-9 and below, the exact drafter 0.24 and 0.70 (seeds 0 and 1)
ROWS_MARGINALS = 4 * ROWS
# temperature, top-k and top-p together, each of them changing the distribution (checked below): a q missing any
# of them is not the distribution the drafter sampled. One sampling structure, so one compiled loop per method.
SAMPLING = SamplingConfig(temperature=1.3, top_k=4, top_p=0.9)


@functools.lru_cache(maxsize=None)
def _target_distribution(sampling: SamplingConfig, prompt: tuple = PROMPT) -> dict[tuple, float]:
    """p(y_1..y_NEW | prompt) for every y in V^NEW, from one forward over all of them."""
    seqs = np.array(list(itertools.product(range(V), repeat=NEW)), np.int32)  # [S, NEW]
    ids = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1))  # [S, P + NEW]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    probs = np.asarray(target_probs(forward(TARGET, CFG, ids, positions).logits, sampling), np.float64)  # [S, L, V]
    p = len(prompt)
    steps = probs[np.arange(len(seqs))[:, None], p - 1 + np.arange(NEW)[None], seqs]  # [S, NEW]
    return {tuple(s): float(x) for s, x in zip(seqs.tolist(), steps.prod(axis=1))}


def _p_value(token_ids: list[list[int]], expected: dict[tuple, float]) -> float:
    """Chi-square p-value of the observed first-NEW-token sequences against `expected` (cells with fewer than 5
    expected counts pooled into one)."""
    counts: dict[tuple, int] = {}
    for row in token_ids:
        counts[tuple(row[:NEW])] = counts.get(tuple(row[:NEW]), 0) + 1
    assert all(expected.get(k, 0.0) > 0 for k in counts), "a sequence the target can never emit came out"
    n = len(token_ids)
    big = [k for k, p in expected.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    wanted = [expected[k] * n for k in big] + [n - sum(expected[k] * n for k in big)]
    if wanted[-1] < 1e-6 * n:  # nothing pooled
        observed, wanted = observed[:-1], wanted[:-1]
    wanted = np.asarray(wanted) * (n / np.sum(wanted))  # the float32 probabilities sum to 1 within 1e-6
    return float(stats.chisquare(observed, wanted).pvalue)


def _registry_method(name: str):
    """The method as the CLI builds it on the tiny target (`build_method`): learned heads untrained (their LM heads
    start as the target's, so their q is far from uniform), the draft model the noisy DRAFT, trees and budgets given
    small by hand (no cost model is measured), pipelines of 2 one-layer stages."""
    spec = METHOD_SPECS[name]
    options = {}
    if spec.learned:
        options["drafter"] = "untrained"
    if "draft_model" in spec.options:
        options["draft_model"] = "tiny-draft"
    if spec.auto == "tree":
        options.update(num_draft_tokens=3, tree_width=2, tree_nodes=5)
    elif spec.auto == "budget":
        options["budget"] = 3 if spec.chain_budget else 5
    elif spec.auto == "chain":
        options["num_draft_tokens"] = spec.default_draft_tokens
    if spec.pipeline:
        options["num_stages"] = 2
    target = LoadedModel(config=CFG, weights=TARGET, tokenizer=None, source="tiny-v8")
    draft = LoadedModel(config=CFG, weights=DRAFT, tokenizer=None, source="tiny-v8-draft")
    with mock.patch.object(methods, "load_model", lambda path, dtype=None: draft):
        return methods.build_method(name, target, methods.MethodOptions(**options))


REGISTRY = [n for n in METHOD_SPECS if n != "autoregressive"]


def _drafters():
    """(label, drafter, params): shapes the registry's defaults do not reach: a draft vocabulary of 6 of the 8 ids
    (6 and 7 never drafted) for the heads, their random matrices scaled so that their q is far from uniform; a
    draft-model tree of top-2 siblings."""
    from jaxspec.drafters.block_head import ParallelHeadConfig
    from jaxspec.drafters.eagle import Eagle3Config

    counts = np.arange(V)[::-1].copy()  # draft vocabulary: the 6 lowest ids
    eagle = Eagle3Config(feature_layers=(0, 1), draft_vocab_size=6, depth=3, top_k=2, num_nodes=5, init_scale=0.5)
    out = [  # (the registry's draft-model is a sampled chain)
        ("draft-model tree (top-2 siblings)", DraftModelDrafter(depth=2, tree_width=2, draft_cfg=CFG), DRAFT),
        ("eagle3 dynamic tree", eagle.for_target(CFG).make_drafter(),
         eagle.init_params(CFG, TARGET, jax.random.key(3), counts)),
        ("eagle3 tree + prompt lookup",  # the lookup chain merged in: duplicates of the head's nodes marked invalid
         dataclasses.replace(eagle.for_target(CFG).make_drafter(), num_nodes=5 + 3, lookup_depth=3),
         eagle.init_params(CFG, TARGET, jax.random.key(3), counts)),
    ]
    for mode, attention in (("dflash", "bidirectional"), ("jetspec", "tree_causal")):  # ddtree: dflash's head
        head = ParallelHeadConfig(attention=attention, feature_layers=(0, 1), draft_vocab_size=6, block_size=3,
                                  budget=5, tree_width=2, refresh_steps=1, init_scale=0.5).for_target(CFG)
        out.append((mode, head.make_drafter(mode), head.init_params(CFG, TARGET, jax.random.key(4), counts)))
    return out


DRAFTERS = _drafters()


def _sampled_rows(drafter, params, seed=0, prompt=PROMPT, rows=ROWS) -> list[list[int]]:
    result = speculative_generate(TARGET, CFG, drafter, params, [list(prompt)] * rows, max_new_tokens=NEW,
                                  sampling=SAMPLING, seed=seed, eos_ids=())
    return result.token_ids


@pytest.fixture(scope="module")
def expected():
    return _target_distribution(SAMPLING)


def test_the_target_distribution_is_far_from_one_hot(expected):
    """The check has power only where the target hesitates: its most likely sequence has well under half the mass,
    and the draft model's first-token distribution is not the target's."""
    assert abs(sum(expected.values()) - 1) < 1e-5
    assert max(expected.values()) < 0.5 and sum(p > 0.01 for p in expected.values()) >= 10
    ids = jnp.asarray([PROMPT])
    positions = jnp.arange(len(PROMPT))[None]
    p, q = (np.asarray(target_probs(forward(w, CFG, ids, positions).logits, SAMPLING)[0, -1]) for w in (TARGET, DRAFT))
    assert 0.5 * np.abs(p - q).sum() > 0.2


def test_temperature_top_k_and_top_p_each_change_the_distribution(expected):
    """SAMPLING's three settings all bind: dropping any one of them moves the target's distribution of the NEW
    tokens by several hundredths, so a q that misses one of them is a different q."""
    for dropped in (dict(temperature=1.0), dict(top_k=0), dict(top_p=1.0)):
        other = _target_distribution(dataclasses.replace(SAMPLING, **dropped))
        assert 0.5 * sum(abs(p - other[k]) for k, p in expected.items()) > 0.05, dropped


@pytest.mark.parametrize("name", REGISTRY)
def test_every_registry_method_samples_the_target_distribution(name, expected):
    """Through Method.generate (the speculative loop, or the pipeline loop for ppsd/spd), with temperature, top-k
    and top-p all in effect."""
    method = _registry_method(name)
    rows = method.generate([list(PROMPT)] * ROWS, max_new_tokens=NEW, sampling=SAMPLING, seed=1,
                           eos_ids=()).token_ids
    assert _p_value(rows, expected) > 1e-3, name


@pytest.mark.parametrize("label,drafter,params", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_sampled_output_follows_the_target_distribution(label, drafter, params, expected):
    rows = ROWS_MARGINALS if label in ("dflash", "jetspec") else ROWS
    assert _p_value(_sampled_rows(drafter, params, rows=rows), expected) > 1e-3, label


def test_drafts_that_run_out_leave_the_distribution_exact():
    """Prompt lookup on RUNS_OUT finds one token to copy: the round's other nodes are padding (valid False), at
    T > 0 with top-k and top-p."""
    history = jnp.zeros((16,), jnp.int32).at[:3].set(jnp.asarray(RUNS_OUT))
    found, _, valid = find_continuation(history, jnp.int32(2), 1, 3)
    assert bool(found) and np.asarray(valid).tolist() == [True, False, False]  # the case under test
    rows = _sampled_rows(PromptLookupDrafter(depth=3), None, prompt=RUNS_OUT)
    assert _p_value(rows, _target_distribution(SAMPLING, RUNS_OUT)) > 1e-3


def test_a_drafter_reporting_the_wrong_q_is_caught(monkeypatch, expected):
    """The same check on a draft-model chain whose reported q keeps mass on tokens top-k / top-p removed (it still
    samples from the processed q): the output distribution moves, and the test sees it."""
    import jaxspec.drafters.draft_model as draft_model

    real = draft_model.draft_chain

    def unfiltered_q(*args, **kwargs):
        tree, carry = real(*args, **kwargs)
        q = tree.draft_probs + 0.3 / V  # [B, T, V]: mass where the sampler never draws
        return dataclasses.replace(tree, draft_probs=q / q.sum(-1, keepdims=True)), carry

    monkeypatch.setattr(draft_model, "draft_chain", unfiltered_q)
    jax.clear_caches()  # the loop compiled for this drafter above must be traced again, with the broken q
    drafter = DraftModelDrafter(depth=3, draft_cfg=CFG)
    assert _p_value(_sampled_rows(drafter, DRAFT), expected) < 1e-6


def test_draws_through_the_bfloat16_screen_follow_the_target_distribution():
    """With a temperature alone on the CPU layout, plain decoding and the speculative loop draw the target's tokens
    by the Gumbel-max rule through the LM head's bfloat16 screen (`greedy_tokens` with noise; the loop checks prompt
    lookup's deterministic drafts against those draws). A target with 16 tokens (the screen needs more than its 8
    candidates), batches small enough for the screen (8 rows x 2 verified tokens, 16 rows x 1): the first two new
    tokens of 4,096 rows each follow the target's distribution, and the compiled loops do call the sampled head."""
    from jaxspec.generate import generate, generate_tokens, pad_prompts
    from jaxspec.model import feature_major_layers, screens_head
    from jaxspec.speculative import loop_arguments, speculative_generate_tokens

    cfg = dataclasses.replace(CFG, vocab_size=16)
    weights = feature_major_layers(init_weights(cfg, jax.random.key(13), scale=0.5))  # per layer, with the screen
    assert weights.head_screen is not None and screens_head(weights, 16)
    sampling, prompt, new = SamplingConfig(temperature=1.3), [1, 3, 0, 2, 1, 3], 2
    seqs = np.array(list(itertools.product(range(16), repeat=new)), np.int32)  # [256, 2]
    ids = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1))
    ref = init_weights(cfg, jax.random.key(13), scale=0.5)  # the same weights, stacked (the reference forward)
    probs = np.asarray(target_probs(forward(ref, cfg, ids, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape))
                                    .logits, sampling), np.float64)  # [256, L, 16]
    steps = probs[np.arange(len(seqs))[:, None], len(prompt) - 1 + np.arange(new)[None], seqs]  # [256, 2]
    expected = {tuple(s): float(p) for s, p in zip(seqs.tolist(), steps.prod(axis=1))}
    assert max(expected.values()) < 0.3  # far from one-hot: the check has power

    drafter = PromptLookupDrafter(depth=1)
    args, kwargs = loop_arguments(weights, cfg, drafter, None, [prompt] * 8, max_new_tokens=new, sampling=sampling,
                                  seed=0, eos_ids=(), max_cache_length=None, mesh=None)
    assert "jaxspec_sampled_head" in speculative_generate_tokens.lower(*args, **kwargs).as_text()
    batch = pad_prompts([prompt] * 16, new, cfg, None)
    plain = generate_tokens.lower(weights, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                                  jax.random.key(0), max_new_tokens=new, cache_size=batch.cache_size,
                                  sampling=sampling, eos_ids=())
    assert "jaxspec_sampled_head" in plain.as_text()

    speculative, autoregressive = [], []
    for seed in range(512):
        speculative += speculative_generate(weights, cfg, drafter, None, [prompt] * 8, max_new_tokens=new,
                                            sampling=sampling, seed=seed, eos_ids=()).token_ids
    for seed in range(256):
        autoregressive += generate(weights, cfg, [prompt] * 16, max_new_tokens=new, sampling=sampling, seed=seed,
                                   eos_ids=()).token_ids
    assert _p_value(speculative, expected) > 1e-3 and _p_value(autoregressive, expected) > 1e-3
