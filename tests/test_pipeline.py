"""Pipeline decoding (PPSD, SPD): the stage executor against the plain forward, greedy output against autoregressive
decoding, the sampled output distribution against the target's exact one, the KV cache after flushes against plain
decoding, and SPD's training block against its inference drafter. The multi-device checks (2, 3 and 5 fake CPU
devices with SmolLM2-135M) run in a child process, since the device count is fixed when JAX starts."""

import dataclasses
import itertools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import run_child

from jaxspec.cache import init_cache
from jaxspec.config import ModelConfig
from jaxspec.drafters.eagle import head_logits
from jaxspec.drafters.ppsd import EarlyExitPipelineDrafter
from jaxspec.drafters.spd import SPDConfig, spd_block_logits, spd_loss
from jaxspec.errors import UserError
from jaxspec.generate import generate, pad_prompts, prefill
from jaxspec.model import embed_tokens, forward, init_weights, lm_head
from jaxspec.pipeline import (
    PipelineView,
    StageCache,
    merge_stages,
    pipeline_generate,
    pipeline_generate_tokens,
    pipeline_step,
    split_stages,
)
from jaxspec.sampling import SamplingConfig, target_probs
from jaxspec.sharding import replicate_on_mesh


def small_model(num_layers=4, vocab=6, scale=0.3, seed=0):
    """A random model small enough to enumerate its output distribution (V = 6)."""
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      max_position_embeddings=256)
    return cfg, init_weights(cfg, jax.random.key(seed), scale=scale)


def spd(cfg, weights, n, num_layers=1, state="input", seed=1, width=1):
    scfg = SPDConfig(num_layers=num_layers, num_stages=n, train_num_stages=(n,), draft_vocab_size=0, state=state)
    return scfg.make_drafter(tree_width=width), scfg.init_params(cfg, weights, jax.random.key(seed))


def drafters(cfg, weights, n, width=1):
    """(label, drafter, params): PPSD and untrained SPD drafters in both states and with 1 and 2 layers, drafting
    `width` lanes (the token and its siblings)."""
    out = [(f"ppsd-W{width}", EarlyExitPipelineDrafter(num_stages=n, tree_width=width), None)]
    for state, layers in (("input", 1), ("input", 2), ("output", 1)):
        out.append((f"spd-{state}-Ls{layers}-W{width}", *spd(cfg, weights, n, layers, state, width=width)))
    return out


# ---------------------------------------------------------------------------------------------- executor


def teacher_forced_logits(cfg, weights, tokens, num_steps, n, mesh=None):
    """Feeds tokens [1, P + K] into the pipeline after prefilling the first P, one per step into stage 0, and
    returns the LM head's logits [K', V] of every token leaving the last stage (K' = K - n + 1)."""
    p = tokens.shape[1] - num_steps
    if mesh is not None:
        weights = replicate_on_mesh(mesh, weights)
    cache = init_cache(cfg, 1, 64)
    _, _, cache = prefill(weights, cfg, tokens[:, :p], jnp.array([p]), cache)
    layers = split_stages(weights.layers, n)
    stage_cache = StageCache(*split_stages((cache.k, cache.v), n))
    x = jnp.zeros((n, 1, 1, cfg.hidden_size))  # [n, B, W, d]
    positions = jnp.zeros((n, 1), jnp.int32)
    active = jnp.zeros((n, 1), jnp.bool_)
    # one compiled step for every step (run eagerly, each op of the mesh's shard_map dispatched on its own took
    # minutes on fake devices)
    step_fn = jax.jit(lambda layers, stage_cache, x, positions, active: pipeline_step(
        cfg, n, layers, stage_cache, x, positions, active, mesh))
    logits = []
    for step in range(num_steps):
        x = x.at[0].set(embed_tokens(weights, cfg, tokens[:, p + step: p + step + 1]))
        positions = positions.at[0].set(p + step)
        active = active.at[0].set(True)
        shifted, _, stage_cache = step_fn(layers, stage_cache, x, positions, active)
        if active[n - 1, 0]:
            logits.append(lm_head(weights, cfg, shifted[0])[0, 0])
        x, positions, active = shifted, jnp.roll(positions, 1, 0), jnp.roll(active, 1, 0)
    return jnp.stack(logits)


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_executor_matches_the_plain_forward(n):
    cfg, weights = small_model(num_layers=4, vocab=32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (1, 12)), jnp.int32)
    got = teacher_forced_logits(cfg, weights, tokens, num_steps=8, n=n)  # tokens 4..11 go through the pipeline
    want = forward(weights, cfg, tokens, jnp.arange(12)[None]).logits[0, 4: 4 + 8 - n + 1]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("width", [1, 3])
def test_greedy_output_equals_autoregressive(tiny_llama3, width):
    _, model, _ = tiny_llama3  # 3 layers: 3 stages of one layer
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=int(rng.integers(4, 12))).tolist() for _ in range(3)]
    reference = generate(model.weights, model.config, prompts, max_new_tokens=20, eos_ids=()).token_ids
    for label, drafter, params in drafters(model.config, model.weights, 3, width):
        result = pipeline_generate(model.weights, model.config, drafter, params, prompts, max_new_tokens=20,
                                   eos_ids=())
        assert result.token_ids == reference, label
        assert result.exits == 3 * 19 and result.steps >= result.exits + 2 * 3, label  # warm-up: n - 1 bubbles


def test_greedy_with_a_perfect_drafter_fills_the_pipeline():
    """A drafter that copies the target's greedy continuation is always accepted: after the warm-up every step
    emits a token, so L'acc = alpha * n approaches n, and the output is still the autoregressive one."""
    cfg, weights = small_model(num_layers=4, vocab=32, scale=0.5)
    prompt = [1, 2, 3]
    reference = generate(weights, cfg, [prompt], max_new_tokens=24, eos_ids=()).token_ids[0]

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Oracle(EarlyExitPipelineDrafter):
        def propose(self, params, state, view, target_weights, target_cfg, sampling, rng):
            index = view.positions[0] + 1 - len(prompt)  # the position the draft will take
            return params[jnp.clip(index, 0, params.shape[0] - 1)][:, None], None, state

    result = pipeline_generate(weights, cfg, Oracle(num_stages=4), jnp.asarray(reference + [0] * 8), [prompt],
                               max_new_tokens=24, eos_ids=())
    assert result.token_ids[0] == reference
    assert result.rejections == 0 and result.bubbles == 3  # only the first warm-up
    assert result.equivalent_acceptance == pytest.approx(23 / 26 * 4)


# ---------------------------------------------------------------------------------------------- sampling


def _chi_square_threshold(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at p = 1e-4 (z = 3.719), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled into one; returns (statistic, dof)."""
    total = counts.sum()
    expected = probs * total
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])), int(keep.sum() - 1)


def exact_distribution(cfg, weights, prompt, length, sampling):
    """p(x_1 .. x_length | prompt) for every sequence over the vocabulary, by enumeration: float64[V ** length]."""
    seqs = np.array(list(itertools.product(range(cfg.vocab_size), repeat=length)), np.int32)  # [V^K, K]
    tokens = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1))
    logits = forward(weights, cfg, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)).logits
    p = np.asarray(target_probs(logits[:, len(prompt) - 1: -1], sampling), np.float64)  # [V^K, K, V]
    return np.prod(np.take_along_axis(p, seqs[..., None], axis=2)[..., 0], axis=1)


T1, T07_K3, T13_P08 = (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
                       SamplingConfig(temperature=1.3, top_p=0.8))


# two stages at W = 1, with each filter, run for ppsd and spd from the registry in test_sampled_loop.py; here the
# deeper pipelines and the siblings that only these counters show
@pytest.mark.optimized  # 3 x 4000 rows through 4 stages: running them unoptimized costs more than compiling
@pytest.mark.parametrize("n,width,kind,sampling", [(4, 1, "ppsd", T07_K3), (4, 2, "ppsd", T1), (4, 2, "spd", T13_P08)])
def test_sampled_output_has_the_target_distribution(n, width, kind, sampling):
    """12,000 sampled 3-token continuations against the target's exact distribution (all 6^3 sequences enumerated):
    Pearson's chi-square stays under its p = 1e-4 quantile. The same samples against the distribution at 1.5x the
    temperature fail it, so the check can fail. Both outcomes of the acceptance rule are exercised (and, with
    W = 2, siblings accepted in the trunk's place)."""
    cfg, weights = small_model(num_layers=4, vocab=6, scale=0.3)
    prompt, length, rows = [1, 2, 3], 3, 4000
    batch = pad_prompts([prompt] * rows, length, cfg, draft_slots=n + 1)
    _, drafter, params = drafters(cfg, weights, n, width)[0 if kind == "ppsd" else 1]  # ppsd or spd-input-Ls1
    exact = exact_distribution(cfg, weights, prompt, length, sampling)
    counts = np.zeros(cfg.vocab_size ** length)
    totals = dict.fromkeys(("rejections", "exits", "promotions"), 0)
    for seed in range(3):
        out, _, stats, _ = pipeline_generate_tokens(
            weights, cfg, drafter, params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
            jax.random.key(seed), max_new_tokens=length, cache_size=batch.cache_size, sampling=sampling)
        codes = np.asarray(out) @ (cfg.vocab_size ** np.arange(length - 1, -1, -1))
        counts += np.bincount(codes, minlength=counts.size)
        for name in totals:
            totals[name] += int(stats[name].sum())
    assert 0.05 * totals["exits"] < totals["rejections"] < 0.95 * totals["exits"], totals
    assert (totals["promotions"] > 100) == (width > 1), totals
    stat, df = _chi_square(counts, exact)
    assert stat < _chi_square_threshold(df), (stat, df)
    other = exact_distribution(cfg, weights, prompt, length,
                               dataclasses.replace(sampling, temperature=sampling.temperature * 1.5))
    stat_other, df_other = _chi_square(counts, other)
    assert stat_other > _chi_square_threshold(df_other), stat_other


# ---------------------------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("sampling,width", [(SamplingConfig(), 1), (SamplingConfig(temperature=1.0), 1),
                                            (SamplingConfig(temperature=1.0), 4)], ids=["greedy", "T1", "T1-W4"])
def test_cache_after_flushes_equals_plain_decoding(tiny_llama3, sampling, width):
    """After a generation full of rejections (an untrained early-exit drafter on a random model), every committed
    slot of every layer holds what a plain prefill of the prompt and the emitted tokens computes. With W = 4 some
    exits accept a sibling instead: its keys and values, copied from the side lanes, must be right too."""
    _, model, _ = tiny_llama3
    cfg, weights = model.config, model.weights
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    batch = pad_prompts(prompts, 24, cfg, draft_slots=4)
    # seed 2, 24 tokens: a run whose W = 4 exits accept a sibling at least once (rare on a random model: an exit
    # keeps a sibling with the target's residual mass on it); the asserts below check that the run has these events
    out, counts, stats, (cache, committed) = pipeline_generate_tokens(
        weights, cfg, EarlyExitPipelineDrafter(num_stages=3, tree_width=width), None, jnp.asarray(batch.tokens),
        jnp.asarray(batch.lengths), jax.random.key(2), max_new_tokens=24, cache_size=batch.cache_size,
        sampling=sampling)
    assert int(stats["rejections"].sum()) > 5
    assert (int(stats["promotions"].sum()) > 0) == (width > 1)
    cache_k, cache_v = merge_stages((cache.k, cache.v))  # [L, B, Hkv, S, h]
    for row, prompt in enumerate(prompts):
        c = int(committed[row])
        text = prompt + np.asarray(out[row]).tolist()
        assert len(prompt) < c <= len(text)
        plain = init_cache(cfg, 1, batch.cache_size)
        _, _, plain = prefill(weights, cfg, jnp.asarray([text[:c]]), jnp.array([c]), plain)
        np.testing.assert_allclose(cache_k[:, row, :, :c], plain.k[:, 0, :, :c], atol=1e-5)
        np.testing.assert_allclose(cache_v[:, row, :, :c], plain.v[:, 0, :, :c], atol=1e-5)


# ---------------------------------------------------------------------------------------------- SPD drafter


def _view_at(cfg, emb, hidden, tokens, i, m, n):
    """The pipeline as the drafter sees it when token i is the newest of m in-flight tokens (batch of one)."""
    s = cfg.num_layers // n
    fields = {k: [] for k in ("tokens", "positions", "active", "hidden", "middle", "out", "out_middle")}
    for j in range(n):  # slot j: token i - j, j stages done
        p = max(i - j, 0)
        fields["tokens"].append(tokens[:, p])
        fields["positions"].append(jnp.array([i - j]))
        fields["active"].append(jnp.array([j < m]))
        fields["hidden"].append(emb[:, p] if j == 0 else hidden[j * s - 1][:, p])
        fields["middle"].append(emb[:, p] if j == 0 else hidden[(j - 1) * s + (s - 1) // 2][:, p])
        fields["out"].append(hidden[(j + 1) * s - 1][:, p])
        fields["out_middle"].append(hidden[j * s + (s - 1) // 2][:, p])
    return PipelineView(committed=jnp.array([i - m + 1]), **{k: jnp.stack(v) for k, v in fields.items()})


@pytest.mark.parametrize("state,num_layers", [("input", 1), ("input", 2), ("output", 2)])
def test_spd_training_block_equals_the_inference_drafter(state, num_layers):
    """spd_block_logits (all positions at once, each with its own occupancy) gives at position i exactly the
    logits SPDDrafter computes from its cache and the in-flight tokens of that pipeline state."""
    cfg, weights = small_model(num_layers=6, vocab=32)
    n = 3
    drafter, params = spd(cfg, weights, n, num_layers, state)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (1, 12)), jnp.int32)
    out = forward(weights, cfg, tokens, jnp.arange(12)[None], hidden_layers=tuple(range(6)), compute_logits=False)
    emb = embed_tokens(weights, cfg, tokens)
    for i, m in ((9, 3), (9, 1), (6, 2), (2, 2)):
        training = spd_block_logits(params, cfg, emb, out.hidden, jnp.full((1, 12), m, jnp.int32), num_stages=n,
                                    state=state)[0, i]
        c = i - m + 1
        st = drafter.init(params, weights, cfg, tokens[:, :c], jnp.array([c]), out.hidden[-1][:, :c], 32)
        h, _ = drafter.block(params, st, _view_at(cfg, emb, out.hidden, tokens, i, m, n), weights, cfg)
        np.testing.assert_allclose(head_logits(params, cfg, h[:, -1])[0], training, atol=2e-5)
    # the check can fail: the occupancy changes the logits (m = 1 against a full pipeline at the same position)
    other = spd_block_logits(params, cfg, emb, out.hidden, jnp.full((1, 12), 1, jnp.int32), num_stages=n,
                             state=state)[0, 9]
    full = spd_block_logits(params, cfg, emb, out.hidden, jnp.full((1, 12), 3, jnp.int32), num_stages=n,
                            state=state)[0, 9]
    assert float(jnp.max(jnp.abs(other - full))) > 1e-3


def test_spd_loss_trains():
    """A few Adam steps on one batch lower the loss of a two-layer SPD drafter at a random stage count."""
    import optax

    cfg, weights = small_model(num_layers=6, vocab=32, scale=0.5)
    _, params = spd(cfg, weights, 3, num_layers=2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 24)), jnp.int32)
    out = forward(weights, cfg, tokens, jnp.broadcast_to(jnp.arange(24), (2, 24)), hidden_layers=tuple(range(6)))
    mask = jnp.ones((2, 24), jnp.bool_)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, key):
        (loss, _), grads = jax.value_and_grad(
            lambda p: spd_loss(p, weights, cfg, tokens, out.hidden, out.last_hidden, mask, key, num_stages=3),
            has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(40):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


# ---------------------------------------------------------------------------------------------- refusals


def test_refusals(tiny_llama3):
    _, model, _ = tiny_llama3
    with pytest.raises(UserError, match="divide the target's 3 layers"):
        pipeline_generate(model.weights, model.config, EarlyExitPipelineDrafter(num_stages=2), None, [[1, 2]])
    with pytest.raises(UserError, match="more than the 256 available"):
        pipeline_generate(model.weights, model.config, EarlyExitPipelineDrafter(num_stages=3), None, [[1] * 500],
                          max_new_tokens=8, max_cache_length=256)
    cfg, weights = small_model(num_layers=6, vocab=32)
    drafter, params = spd(cfg, weights, 3)
    other_cfg, other_weights = small_model(num_layers=6, vocab=32)
    other_cfg = dataclasses.replace(other_cfg, hidden_size=48)
    with pytest.raises(UserError, match="width 32"):
        drafter.check_compatible(params, other_cfg)


# ---------------------------------------------------------------------------------------------- devices

NUM_FAKE_DEVICES = 3
# (devices, stages, method): one stage per device (spd), and two stages per device (ppsd); the one-device emulation
# of the same pipelines is checked in-process (test_greedy_output_equals_autoregressive)
MESH_CASES = [(3, 3, "spd"), (3, 6, "ppsd")]


@pytest.fixture(scope="module")
def child_results():
    return run_child(__file__, NUM_FAKE_DEVICES, timeout=1800)


def test_greedy_on_stage_devices_equals_autoregressive(child_results):
    reference = child_results["autoregressive"]
    assert len(set(map(tuple, reference))) > 1
    for case in MESH_CASES:
        name = "{}dev-{}stages-{}".format(*case)
        assert child_results["mesh"][name] == reference, name


def test_mesh_executor_logits_equal_one_device(child_results):
    for name, diff in child_results["executor"].items():
        assert diff["mesh_vs_one_device"] <= 1e-5, (name, diff)
        assert diff["one_device_vs_forward"] <= 1e-3, (name, diff)
        assert diff["steps"] >= 4, name


def _child() -> dict:
    from test_sharding import random_weights, tiny_config

    from jaxspec.loading import LoadedModel
    from jaxspec.methods import MethodOptions, build_method

    assert len(jax.devices()) == NUM_FAKE_DEVICES, jax.devices()
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)  # the stage layout is under test, not CPU code generation
    # a tiny random 6-layer model (stage counts 2, 3 and 6 divide it): the stage layout is under test, not the
    # model, and SmolLM2 cost minutes of compilation per case on fake devices
    cfg = dataclasses.replace(tiny_config("llama", 4), num_layers=6, max_position_embeddings=256)
    # weights committed to one device, as after a user's device_put: the mesh methods must still take them
    weights = jax.device_put(random_weights(cfg, seed=5), jax.devices()[0])
    target = LoadedModel(config=cfg, weights=weights, tokenizer=None, source="tiny-llama-6-layers")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 11)]
    new = 12
    results = {"autoregressive": generate(weights, cfg, prompts, max_new_tokens=new, eos_ids=()).token_ids,
               "mesh": {}, "executor": {}}
    for devices, n, method in MESH_CASES:
        name = f"{devices}dev-{n}stages-{method}"
        options = MethodOptions(num_stages=n, stage_devices=devices, drafter="untrained" if method == "spd" else None)
        built = build_method(method, target, options)
        results["mesh"][name] = built.generate(prompts, max_new_tokens=new, eos_ids=()).token_ids
        jax.clear_caches()
    from jaxspec.pipeline import stage_mesh

    tokens = jnp.asarray([prompts[0] + prompts[1]], jnp.int32)
    for devices, n in ((3, 3), (3, 6)):
        steps = 9
        one = np.asarray(teacher_forced_logits(cfg, weights, tokens, steps, n))
        mesh = np.asarray(teacher_forced_logits(cfg, weights, tokens, steps, n, stage_mesh(n, devices)))
        full = np.asarray(forward(weights, cfg, tokens, jnp.arange(tokens.shape[1])[None]).logits[0])
        p = tokens.shape[1] - steps
        results["executor"][f"{devices}dev-{n}stages"] = {
            "mesh_vs_one_device": float(np.max(np.abs(mesh - one))),
            "one_device_vs_forward": float(np.max(np.abs(one - full[p: p + one.shape[0]]))),
            "steps": int(one.shape[0])}
    return results


if __name__ == "__main__" and "--child" in sys.argv:
    print(json.dumps(_child()))
