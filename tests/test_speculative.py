"""The speculative decoding loop: greedy output identical to autoregressive for every drafter, sampled drafts from
the target itself always accepted, cache commits equal plain decoding, no recompilation, clear refusals."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec.cache import commit_positions, init_cache
from jaxspec.drafters import DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter, RoundInputs
from jaxspec.drafters.draft_model import check_same_vocabulary
from jaxspec.errors import UserError
from jaxspec.generate import generate, prefill
from jaxspec.methods import MethodOptions, build_method
from jaxspec.sampling import GREEDY, SamplingConfig, target_probs
from jaxspec.speculative import speculative_generate, speculative_generate_tokens
from jaxspec.tokenizer import encode_prompt
from jaxspec.verification import accept, verify_forward


def _tiny_prompts(ref):
    ids = ref["input_ids"]
    return [ids[0, :5].tolist(), ids[1, :17].tolist(), ids[0, 3:40].tolist()]


def _tiny_drafters(model):
    from jaxspec import load_model

    other = load_model(fixture_path("tiny-qwen2"))  # same vocabulary size, different random weights
    # the methods' default chains (prompt lookup, early exit, a draft model of depth 4) run from the registry in
    # test_registry.py; here the other shapes: prompt lookup on bigrams, a draft model that is the target, trees
    return [
        (PromptLookupDrafter(depth=4, max_ngram=2), None),
        (DraftModelDrafter(depth=2, draft_cfg=model.config), model.weights),
        (DraftModelDrafter(depth=3, tree_width=3, draft_cfg=other.config), other.weights),
        (EarlyExitDrafter(depth=2, tree_width=2, exit_layer=2), None),
    ]


def test_greedy_equals_autoregressive_for_every_drafter_on_a_tiny_model(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _tiny_prompts(ref)
    for batch in (prompts[:1], prompts):  # batch 1, and 3 rows of different lengths
        expected = generate(model.weights, model.config, batch, max_new_tokens=24, eos_ids=()).token_ids
        for drafter, params in _tiny_drafters(model):
            result = speculative_generate(model.weights, model.config, drafter, params, batch, max_new_tokens=24,
                                          eos_ids=())
            assert result.token_ids == expected, drafter.name
            assert all(1 <= r <= 24 for r in result.rounds)


def test_eos_and_max_new_tokens_per_row(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _tiny_prompts(ref)
    free = generate(model.weights, model.config, prompts, max_new_tokens=20, eos_ids=()).token_ids
    eos = free[1][6]
    expected = generate(model.weights, model.config, prompts, max_new_tokens=20, eos_ids=(eos,)).token_ids
    drafter = DraftModelDrafter(depth=4, draft_cfg=model.config)
    result = speculative_generate(model.weights, model.config, drafter, model.weights, prompts, max_new_tokens=20,
                                  eos_ids=(eos,))
    assert result.token_ids == expected
    assert len(result.token_ids[1]) <= 7


def test_target_drafting_for_itself_is_always_accepted(tiny_llama3):
    """Draft = target: greedy drafts always match; sampled drafts have q = p, so min(1, p/q) = 1 as well."""
    _, model, ref = tiny_llama3
    prompts = _tiny_prompts(ref)
    drafter = DraftModelDrafter(depth=3, draft_cfg=model.config)
    for sampling in (GREEDY, SamplingConfig(temperature=0.9, top_k=50)):
        result = speculative_generate(model.weights, model.config, drafter, model.weights, prompts,
                                      max_new_tokens=17, sampling=sampling, eos_ids=())
        assert all(a == 3 for row in result.accepted for a in row), result.accepted
        assert result.tau == 4.0 and result.rounds == [4, 4, 4]  # 1 + 4 rounds x 4 = 17 tokens


def test_sampling_is_reproducible(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _tiny_prompts(ref)
    drafter = PromptLookupDrafter(depth=3)
    run = [speculative_generate(model.weights, model.config, drafter, None, prompts, max_new_tokens=12,
                                sampling=SamplingConfig(temperature=1.0), seed=s, eos_ids=()).token_ids
           for s in (5, 5, 6)]
    assert run[0] == run[1] and run[0] != run[2]


def test_commit_leaves_the_cache_of_plain_decoding(tiny_llama3):
    """Three rounds by hand: after each commit, the committed slots equal those of prefilling the same tokens."""
    _, model, ref = tiny_llama3
    cfg, w = model.config, model.weights
    prompts = jnp.asarray(ref["input_ids"][:, :10])  # [2, 10]
    lengths = jnp.array([10, 7], jnp.int32)
    drafter = DraftModelDrafter(depth=3, draft_cfg=cfg)
    history = jnp.zeros((2, 64), jnp.int32).at[:, :10].set(prompts)
    cache = init_cache(cfg, 2, 64)
    logits, out, cache = prefill(w, cfg, prompts, lengths, cache)
    root = jnp.argmax(logits, -1).astype(jnp.int32)
    history = history.at[jnp.arange(2), lengths].set(root)
    state = drafter.init(w, cfg, prompts, lengths, out, 64, GREEDY)
    # a drafter that disagrees sometimes: the draft model with perturbed weights
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(0), x.shape), w)
    for round_index in range(3):
        inputs = RoundInputs(target_weights=w, target_cache=cache, history=history, lengths=cache.lengths, root=root)
        tree, state, cache = drafter.propose(noisy, state, inputs, cfg, GREEDY, jax.random.key(round_index))
        verification = verify_forward(w, cfg, cache, root, tree)
        acc = accept(tree, target_probs(verification.logits, GREEDY), jnp.zeros((2, 3)), jnp.zeros(2))
        start = cache.lengths
        cache = commit_positions(verification.cache, acc.path, acc.num_accepted + 1)
        for row in range(2):
            new = acc.tokens[row, : int(acc.num_accepted[row]) + 1]
            history = history.at[row, int(start[row]) + 1: int(start[row]) + 1 + new.shape[0]].set(new)
        root = acc.bonus
        # plain decoding of the same committed tokens
        for row in range(2):
            n = int(cache.lengths[row])
            plain = init_cache(cfg, 1, 64)
            _, _, plain = prefill(w, cfg, history[row: row + 1, :n], jnp.array([n]), plain)
            np.testing.assert_allclose(np.asarray(cache.k[:, row, :, :n]), np.asarray(plain.k[:, 0, :, :n]),
                                       atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.v[:, row, :, :n]), np.asarray(plain.v[:, 0, :, :n]),
                                       atol=1e-5)
    assert int(cache.lengths[0]) > 10 and int(cache.lengths[1]) > 7


def test_one_compilation_serves_a_whole_generation_and_new_prompts(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _tiny_prompts(ref)
    drafter = PromptLookupDrafter(depth=5)
    speculative_generate(model.weights, model.config, drafter, None, prompts[:1], max_new_tokens=30, eos_ids=())
    before = speculative_generate_tokens._cache_size()
    speculative_generate(model.weights, model.config, drafter, None, [prompts[1][:9]], max_new_tokens=30, eos_ids=())
    speculative_generate(model.weights, model.config, drafter, None, [prompts[2][:30]], max_new_tokens=30, eos_ids=())
    assert speculative_generate_tokens._cache_size() == before


# ---------------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def chat_prompts(smollm2, smollm2_reference):
    prompts = json.loads(str(smollm2_reference["prompts"]))
    extra = ["Repeat this list twice: apple, banana, cherry, date.", "def add(a, b):\n    return a + b\n\nExplain it."]
    return [encode_prompt(smollm2.tokenizer, p) for p in prompts + extra]


@pytest.fixture(scope="module")
def chat_greedy(smollm2, chat_prompts):
    """Plain greedy decoding of the chat prompts, 40 new tokens (a batch of six SmolLM2 rows: 9 s on 2 cores, so
    computed once for the methods compared with it)."""
    return generate(smollm2.weights, smollm2.config, chat_prompts, max_new_tokens=40).token_ids


@pytest.mark.parametrize("method,options", [
    ("prompt-lookup", MethodOptions(num_draft_tokens=4)),
    ("early-exit", MethodOptions(num_draft_tokens=2, exit_layer=6)),
])
def test_greedy_equals_autoregressive_on_smollm2(smollm2, chat_prompts, chat_greedy, method, options):
    # rows of different lengths in one batch (batch 1 and 3 of every method run on a tiny model in test_registry.py)
    result = build_method(method, smollm2, options).generate(chat_prompts, max_new_tokens=40)
    assert result.token_ids == chat_greedy
    assert result.tau >= 1.0


def test_smollm2_drafting_for_itself_accepts_everything(smollm2, chat_prompts):
    drafter = DraftModelDrafter(depth=3, draft_cfg=smollm2.config)
    expected = generate(smollm2.weights, smollm2.config, chat_prompts[:2], max_new_tokens=25).token_ids
    result = speculative_generate(smollm2.weights, smollm2.config, drafter, smollm2.weights, chat_prompts[:2],
                                  max_new_tokens=25)
    assert result.token_ids == expected
    assert all(a == 3 for row in result.accepted for a in row[:-1])  # the last round may stop at EOS


# ---------------------------------------------------------------------------------------------- refusals


class _FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_llama3):
    _, model, _ = tiny_llama3
    a = _FakeTokenizer({f"t{i}": i for i in range(200)})
    b = _FakeTokenizer({**{f"t{i}": i for i in range(200)}, "t7": 8, "t8": 7})
    check_same_vocabulary(model.config, model.config, a, a)
    with pytest.raises(UserError, match="tokenizer differs"):
        check_same_vocabulary(model.config, model.config, a, b)
    small = dataclasses.replace(model.config, vocab_size=100)
    with pytest.raises(UserError, match="vocabulary is only 100"):
        check_same_vocabulary(model.config, small, a, a)


def test_bad_method_options_are_refused(tiny_llama3):
    _, model, _ = tiny_llama3
    with pytest.raises(UserError, match="exit-layer"):
        build_method("early-exit", model, MethodOptions(exit_layer=99))
    with pytest.raises(UserError, match="--draft-model"):
        build_method("draft-model", model)
    with pytest.raises(UserError, match="Unknown method"):
        build_method("medusa-9000", model)
    with pytest.raises(UserError, match="tree-width"):
        build_method("prompt-lookup", model, MethodOptions(tree_width=2))
    with pytest.raises(UserError, match="num-draft-tokens"):
        build_method("prompt-lookup", model, MethodOptions(num_draft_tokens=0))




def test_a_draft_model_runs_rounded_to_bfloat16_in_the_per_layer_cpu_layout(tiny_llama3, monkeypatch):
    """In the per-layer CPU layout with jaxspec's kernels a draft model's layer matrices (and its LM head's rows,
    where the layout screens them) are kept in bfloat16 (half the bytes a drafted token reads): its forward then
    equals, bit for bit, the float32 forward of the same matrices rounded to bfloat16, and the target's greedy output
    is still plain decoding's. storage="float32" keeps them as
    loaded; an unknown storage is refused."""
    from jaxspec import load_model
    from jaxspec.kernels import kernels_on
    from jaxspec.model import FeatureMajorLayer, feature_major_layers, forward

    if jax.default_backend() != "cpu" or not kernels_on():
        pytest.skip("the bfloat16 draft model is the per-layer CPU layout's, with jaxspec's kernels")
    _, model, ref = tiny_llama3
    monkeypatch.setenv("JAXSPEC_LAYERS", "unstacked")
    other = load_model(fixture_path("tiny-qwen2"))  # a draft model with biases, other random weights
    drafter = DraftModelDrafter(depth=3, draft_cfg=other.config)
    executed = drafter.execution_params(other.weights)
    matrices = ("wqkv", "wo", "w_gate_up", "w_down")
    assert all(isinstance(lw, FeatureMajorLayer) for lw in executed.layers)
    assert {getattr(lw, name).dtype for lw in executed.layers for name in matrices} == {jnp.dtype(jnp.bfloat16)}
    assert executed.embed.dtype == jnp.float32 and executed.layers[0].bqkv.dtype == jnp.float32
    float32 = feature_major_layers(other.weights)
    rounded = dataclasses.replace(float32, layers=tuple(
        dataclasses.replace(lw, **{name: getattr(lw, name).astype(jnp.bfloat16).astype(jnp.float32)
                                   for name in matrices}) for lw in float32.layers))
    if float32.head_screen is not None:  # the LM head's rows, screened: rounded too, the screen's own matrix
        assert executed.head_screen.rows is executed.head_screen.matrix
        rounded = dataclasses.replace(rounded, head_screen=dataclasses.replace(
            float32.head_screen, rows=float32.head_screen.matrix.astype(jnp.float32)))
    tokens = jnp.asarray([_tiny_prompts(ref)[1][:6]], jnp.int32)  # [1, 6]
    for n in (1, 2, 6):  # one drafted token, the round's first two, a prefill
        cache = init_cache(other.config, 1, 32, jnp.float32, per_layer=True)
        positions = jnp.arange(n, dtype=jnp.int32)[None]  # [1, n]
        got = forward(executed, other.config, tokens[:, :n], positions, cache).logits  # [1, n, V]
        np.testing.assert_array_equal(got, forward(rounded, other.config, tokens[:, :n], positions, cache).logits)
    prompts = _tiny_prompts(ref)
    for batch in (prompts[:1], prompts):
        expected = generate(model.weights, model.config, batch, max_new_tokens=16, eos_ids=()).token_ids
        result = speculative_generate(model.weights, model.config, drafter, other.weights, batch, max_new_tokens=16,
                                      eos_ids=())
        assert result.token_ids == expected
    kept = DraftModelDrafter(depth=3, draft_cfg=other.config, storage="float32").execution_params(other.weights)
    assert kept.layers[0].wqkv.dtype == jnp.float32
    with pytest.raises(UserError, match="storage"):
        DraftModelDrafter(depth=3, draft_cfg=other.config, storage="int8")


def test_methods_naming_the_same_draft_model_share_its_weights(tiny_llama3):
    """A --num-draft-tokens sweep builds one draft-model method per K: they load the draft model once (a copy per K,
    each with its CPU layout, once ran a 23 GB host out of memory); another draft model replaces it."""
    _, model, _ = tiny_llama3
    path = fixture_path("tiny-qwen2")
    two, three = (build_method("draft-model", model, MethodOptions(draft_model=path, num_draft_tokens=k))
                  for k in (2, 3))
    assert (two.drafter.depth, three.drafter.depth) == (2, 3) and two.params is three.params
    other = build_method("draft-model", model, MethodOptions(draft_model=fixture_path("tiny-llama3"),
                                                             num_draft_tokens=2))
    assert other.params is not two.params
    again = build_method("draft-model", model, MethodOptions(draft_model=path, num_draft_tokens=2))
    assert again.params is not two.params  # the last one loaded is kept, not every one
    jax.tree.map(np.testing.assert_array_equal, again.params, two.params)


def _noisy_copy(weights, scale: float = 0.15):
    """The target's weights, each matrix perturbed by relative Gaussian noise: a draft model that agrees with the
    target often, not always."""
    leaves, tree = jax.tree.flatten(weights)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [w * (1 + scale * jax.random.normal(k, w.shape, w.dtype)) if w.ndim >= 2 else w
             for w, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, noisy)


def test_a_draft_models_chain_statistics_predict_every_round_of_the_decoding_loop(tiny_llama3):
    """`chain_statistics`' ranks, teacher-forced along the target's greedy answers, predict the real decoding loop
    round by round: a chain of K keeps exactly its leading rank-0 drafts (at most K) at each round's root, on 3 rows
    of different lengths. A draft model that is the target ranks every token first and keeps every sampled level."""
    from jaxspec.drafters.draft_model import NOT_DRAFTED, chain_statistics

    _, model, ref = tiny_llama3
    cfg, prompts, k, new = model.config, _tiny_prompts(ref), 3, 24
    draft = _noisy_copy(model.weights)
    answers = generate(model.weights, cfg, prompts, max_new_tokens=new, eos_ids=()).token_ids
    lengths = np.array([len(p) + len(a) for p, a in zip(prompts, answers)])  # [R]
    tokens = np.zeros((3, lengths.max()), np.int64)  # [R, S]
    for row, (p, a) in enumerate(zip(prompts, answers)):
        tokens[row, : lengths[row]] = p + a
    starts = np.array([len(p) for p in prompts])  # [R]
    ranks, mass = chain_statistics(draft, cfg, model.weights, cfg, tokens, lengths, starts, 6)
    assert ranks.shape == (int(np.sum(lengths - starts - 1)), 6) and mass.shape == (len(ranks), 6, 0)
    result = speculative_generate(model.weights, cfg, DraftModelDrafter(depth=k, draft_cfg=cfg), draft, prompts,
                                  max_new_tokens=new, eos_ids=())
    assert result.token_ids == answers
    offsets = np.concatenate([[0], np.cumsum(lengths - starts - 1)])  # [R + 1]: each row's first root in `ranks`
    checked, kept = 0, 0
    for row, accepted in enumerate(result.accepted):
        root = starts[row]  # the first round's root: the first generated token
        for got in accepted:
            if root + k + 1 >= lengths[row]:  # the last rounds stop at max_new_tokens
                break
            leading = int(np.cumprod(ranks[offsets[row] + root - starts[row], :k] == 0).sum())
            assert got == leading, (row, root)
            checked, kept = checked + 1, kept + got
            root += got + 1
    assert checked >= 15 and 0 < kept < checked * k  # rounds that keep some drafts and miss others
    assert ranks[offsets[1] - 1, 0] != NOT_DRAFTED and ranks[offsets[1] - 1, 1] == NOT_DRAFTED  # a row's last root
    same_ranks, same_mass = chain_statistics(model.weights, cfg, model.weights, cfg, tokens, lengths, starts, 4,
                                             temperature=1.0)
    inside = same_ranks != NOT_DRAFTED  # [P, 4]
    assert np.all(same_ranks[inside] == 0)
    np.testing.assert_allclose(same_mass[..., 0][inside], 1.0, atol=1e-5)
    assert np.all(same_mass[..., 0][~inside] == 0)


def test_a_draft_model_sizes_its_chain_for_the_device_by_default(tiny_llama3, tmp_path, monkeypatch):
    """Without --num-draft-tokens a draft model's chain length is chosen per batch size (--budget auto) from the
    device's cost model and the draft model's acceptance measured along the target's answers (cached per pair): the
    argmax of its own throughput table, a long chain where verification is nearly free, no draft where every
    verified token is dear; greedy output is plain decoding's either way. A chain by hand keeps the given K."""
    from unittest import mock

    from jaxspec import methods
    from jaxspec.budget import CHAIN_TOKEN_COUNTS, DEFAULT_CONTEXT, CostModel, cost_device, cost_model_path
    from jaxspec.loading import LoadedModel

    _, tiny, ref = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    # a target whose last two layers add little (their output projections scaled down), and its first layer with
    # the LM head as the draft model: a third of its layers, right about 0.9 of the time
    layers, scale = tiny.weights.layers, jnp.asarray([1.0, 0.05, 0.05])  # [L]
    layers = dataclasses.replace(layers, wo=layers.wo * scale[:, None, None, None],
                                 w_down=layers.w_down * scale[:, None, None])
    model = dataclasses.replace(tiny, weights=dataclasses.replace(tiny.weights, layers=layers))
    draft = LoadedModel(config=dataclasses.replace(model.config, num_layers=1), tokenizer=None, source="tiny-first",
                        weights=dataclasses.replace(model.weights, layers=jax.tree.map(lambda x: x[:1], layers)))
    prompts = _tiny_prompts(ref)

    def save_costs(per_token: float) -> None:  # batch 1 and 3: seconds grow by per_token of a step per token
        for sampled in (False, True):
            seconds = [[0.01 * b * (1 + per_token * (t - 1)) for t in CHAIN_TOKEN_COUNTS] for b in (1, 3)]
            CostModel(device=cost_device(model, sampled), model=model.fingerprint(), batch_sizes=[1, 3],
                      token_counts=list(CHAIN_TOKEN_COUNTS), seconds=seconds, context=DEFAULT_CONTEXT).save(
                cost_model_path(model, sampled=sampled))

    def build(**options):
        with mock.patch.object(methods, "load_model", lambda path, dtype=None: draft):
            return build_method("draft-model", model, MethodOptions(draft_model="tiny-first", **options))

    save_costs(0.01)
    method = build()
    assert method.cost_model is not None and method.tree_ranks.shape[1] == 10 and method.draft_mass.shape[2] == 1
    for greedy in (True, False):
        shape, rows = method.auto_tree(1, greedy)
        best = max(rows, key=lambda r: r["tokens_per_second"])
        assert best["chosen"] and best["shape"] == shape and shape.depth >= 3, rows
    chosen, table, _ = method.auto_table(1)
    assert chosen.startswith("a chain of") and "speedup" in table
    for batch in (prompts[:1], prompts):
        expected = generate(model.weights, model.config, batch, max_new_tokens=20, eos_ids=()).token_ids
        assert method.generate(batch, max_new_tokens=20, eos_ids=()).token_ids == expected
    assert method.drafter_for_batch(1).depth == method.auto_tree(1)[0].depth
    with mock.patch("jaxspec.drafters.draft_model.chain_statistics", side_effect=AssertionError("measured again")):
        again = build()  # the measured profile is read back from the cache
    np.testing.assert_array_equal(again.tree_ranks, method.tree_ranks)
    save_costs(3.0)  # every verified token costs three steps: no chain pays
    dear = build()
    assert dear.drafter_for_batch(1) is None and dear.auto_table(1)[0].startswith("no draft")
    expected = generate(model.weights, model.config, prompts, max_new_tokens=12, eos_ids=()).token_ids
    assert dear.generate(prompts, max_new_tokens=12, eos_ids=()).token_ids == expected
    by_hand = build(num_draft_tokens=2)
    assert by_hand.cost_model is None and by_hand.drafter.depth == 2
    with pytest.raises(UserError, match="not both"):
        build(num_draft_tokens=2, budget="auto")
    with pytest.raises(UserError, match="not a number"):
        build(budget=4)
