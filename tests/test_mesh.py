"""Speculative generation on a (data, model) device mesh gives the same tokens as on one device.

Like test_sharding.py, this file doubles as a script: the module fixture runs `python tests/test_mesh.py --child`
in a fresh process with 8 fake CPU devices (the flag must be set before JAX starts), the child decodes with every
method on one device and on the meshes, and prints one JSON line that the tests below assert on.

The target is a tiny random Qwen2 (8 query and 8 key/value heads, f=128, V=256) so that every mesh of 8 devices
(8x1, 2x4, 1x8 and others) splits it. Its draft model is the target with small noise added to every weight: a drafter
that is right most of the time but not always, so rows accept different numbers of tokens in a round.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from fake_devices import run_child

from jaxspec.errors import UserError
from jaxspec.sharding import parse_mesh

NUM_FAKE_DEVICES = 8
# data x model: both axes (rows, heads and vocabulary split), and the model axis alone (heads and vocabulary in 8
# slices); rows alone are the data axis of 2x4
MESHES = ("2x4", "1x8")
# ragged prompts: 8 rows of different lengths (one of a single token)
PROMPT_LENGTHS = (16, 5, 9, 1, 12, 14, 3, 7)
MAX_NEW_TOKENS = 12
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 0.9}
# (name, method, MethodOptions fields) run on one device and on every mesh, greedy and (on 2x4) sampled
CORE_METHODS = (
    ("autoregressive", "autoregressive", {}),
    ("chain", "draft-model", {"num_draft_tokens": 3}),
    ("eagle2", "eagle2", {"drafter": "untrained", "num_draft_tokens": 3, "tree_width": 2, "tree_nodes": 6}),
)
# one method of every other kind of drafter, greedy on the 2x4 mesh, against autoregressive decoding on that mesh
# (early-exit drafts like ppsd's first stage, eagle like eagle2 with a fixed tree, ddtree like jetspec without its
# refresh: the same sharded code paths)
OTHER_METHODS = (
    ("tree", "draft-model", {"num_draft_tokens": 3, "tree_width": 2}),
    ("prompt-lookup", "prompt-lookup", {}),
    ("medusa", "medusa", {"drafter": "untrained"}),
    ("eagle3", "eagle3", {"drafter": "untrained", "num_draft_tokens": 3, "tree_width": 2, "tree_nodes": 6}),
    ("dflash", "dflash", {"drafter": "untrained"}),
    ("jetspec", "jetspec", {"drafter": "untrained", "budget": 8}),
    ("ppsd", "ppsd", {}),  # pipelines: their own loop, partitioned by jit over rows and heads (2 stages of 1 layer)
    ("spd", "spd", {"drafter": "untrained"}),
)


# ---------------------------------------------------------------------------------------------- in-process checks


def test_parse_mesh():
    assert parse_mesh("data=4,model=2") == (4, 2)
    assert parse_mesh("model=8") == (1, 8)
    assert parse_mesh(" data = 2 , model=4 ") == (2, 4)
    for bad, message in (("pipe=2", "unknown axis 'pipe'"), ("data=0", "positive integer"),
                         ("data=2,data=4", "repeated axis"), ("data=x", "positive integer"), ("", "names no axis")):
        with pytest.raises(UserError, match=message):
            parse_mesh(bad)


def test_pipeline_methods_take_one_kind_of_mesh(tiny_llama3):
    from jaxspec.methods import MethodOptions, build_method

    with pytest.raises(UserError, match="either --stage-devices .* or --mesh"):
        build_method("ppsd", tiny_llama3[1], MethodOptions(mesh="data=1", stage_devices=2))


# ---------------------------------------------------------------------------------------------- the child's results


@pytest.fixture(scope="module")
def child_results():
    return run_child(__file__, NUM_FAKE_DEVICES, timeout=1800)


@pytest.mark.parametrize("mesh,mode", [(m, "greedy") for m in MESHES] + [("2x4", "sampled")])
@pytest.mark.parametrize("name", [m[0] for m in CORE_METHODS])
def test_same_tokens_as_one_device(child_results, mesh, name, mode):
    one, on_mesh = child_results["one_device"][mode][name], child_results["mesh"][mesh][mode][name]
    assert on_mesh["tokens"] == one["tokens"]
    assert on_mesh["accepted"] == one["accepted"]  # the same rounds, each accepting the same number of tokens


@pytest.mark.parametrize("name", [m[0] for m in OTHER_METHODS])
def test_every_method_runs_on_the_mesh(child_results, name):
    """Greedy on the mesh equals autoregressive decoding (test_registry checks the same methods on one device)."""
    greedy = child_results["mesh"]["2x4"]["greedy"]
    assert greedy[name]["tokens"] == greedy["autoregressive"]["tokens"]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_the_checks_are_not_vacuous(child_results, mode):
    """Speculation equals autoregressive decoding at T=0 (losslessness, on the mesh too); rows are ragged and accept
    different lengths; at T>0 drafts are rejected as well as accepted and the sample differs from the greedy one."""
    results = child_results["mesh"]["2x4"][mode]
    lengths = [len(row) for row in results["chain"]["tokens"]]
    assert all(n == MAX_NEW_TOKENS for n in lengths)
    per_row = [sum(row) / len(row) for row in results["chain"]["accepted"]]
    assert len(set(per_row)) > 2, per_row  # rows accept different numbers of tokens
    flat = [a for row in results["chain"]["accepted"] for a in row]
    assert 0 in flat and max(flat) >= 2, flat  # some rounds reject the first draft, some accept several
    if mode == "greedy":
        assert results["chain"]["tokens"] == results["autoregressive"]["tokens"]
        assert results["tree"]["tokens"] == results["autoregressive"]["tokens"]
        assert results["eagle2"]["tokens"] == results["autoregressive"]["tokens"]
    else:
        assert results["autoregressive"]["tokens"] != child_results["mesh"]["2x4"]["greedy"]["autoregressive"]["tokens"]


def test_weights_are_split_on_the_mesh(child_results):
    # per device: wq holds 8 / model heads; the embedding 256 / model rows
    assert child_results["local_shapes"] == {m: {"wq_heads": 8 // int(m[-1]), "embed_rows": 256 // int(m[-1])}
                                             for m in MESHES}


def test_sharded_acceptance_equals_one_device(child_results):
    """process_logits and the acceptance rule on vocabulary slices (1x8 mesh) against one device, same uniforms."""
    r = child_results["acceptance"]
    for case, diff in r["probs"].items():
        assert diff <= 1e-6, (case, diff)
    assert all(r["same_outcome"].values()), r["same_outcome"]
    assert r["rejections"] > 0 and r["acceptances"] > 0


def test_a_mesh_that_does_not_divide_is_refused_before_any_work(child_results):
    refused = child_results["refused"]
    assert "batch of 6 rows does not split over the mesh's data axis of size 4" in refused["batch"]
    assert "model axis of size 8 does not divide num_kv_heads=4" in refused["heads"]
    assert "needs 4 devices, but 8 are available" in refused["devices"]


# ---------------------------------------------------------------------------------------------- child process


def _noisy(weights, scale: float, seed: int):
    """The weights plus Gaussian noise of `scale` times each array's own standard deviation."""
    leaves, treedef = jax.tree.flatten(weights)
    rng = np.random.default_rng(seed)
    noisy = [np.asarray(x) + scale * np.std(np.asarray(x)) * rng.standard_normal(np.shape(x)).astype(np.float32)
             for x in leaves]
    return jax.tree.unflatten(treedef, noisy)


def _child() -> dict:
    import jax.numpy as jnp
    from test_sharding import random_weights, tiny_config

    from jaxspec import sharding
    from jaxspec.drafters import DraftModelDrafter
    from jaxspec.loading import LoadedModel
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.sampling import GREEDY, SamplingConfig, target_probs
    from jaxspec.speculative import speculative_generate
    from jaxspec.tree import DraftTree
    from jaxspec.verification import accept, verify_and_accept

    assert len(jax.devices()) == NUM_FAKE_DEVICES, jax.devices()
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)  # partitioning is under test, not CPU code generation
    cfg = dataclasses.replace(tiny_config("qwen2", 8), max_position_embeddings=256)
    target = LoadedModel(config=cfg, weights=jax.tree.map(np.asarray, random_weights(cfg, seed=3)), tokenizer=None,
                         source="tiny-qwen2-mesh")
    draft_weights = _noisy(target.weights, 0.2, seed=4)  # the draft model: the target plus noise
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    modes = {"greedy": GREEDY, "sampled": SamplingConfig(**SAMPLED)}

    def run(name, method, fields, mesh, sampling):
        kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, sampling=sampling, seed=5, eos_ids=())
        if method == "draft-model":  # through the API: the drafter and its weights built by hand
            drafter = DraftModelDrafter(depth=fields["num_draft_tokens"], tree_width=fields.get("tree_width", 1),
                                        draft_cfg=cfg)
            device_mesh = None if mesh is None else sharding.make_mesh(*sharding.parse_mesh(mesh))
            params = draft_weights  # the draft model split over the model axis, as the method registry does
            if device_mesh is not None:
                params = sharding.shard_weights(draft_weights, device_mesh)
            r = speculative_generate(target.weights, cfg, drafter, params, prompts, mesh=device_mesh, **kwargs)
        else:  # through the method registry, as the CLI does
            r = build_method(method, target, MethodOptions(mesh=mesh, **fields)).generate(prompts, **kwargs)
        return {"tokens": r.token_ids, "accepted": getattr(r, "accepted", None)}

    results = {"one_device": {}, "mesh": {}}
    for mode, sampling in modes.items():
        results["one_device"][mode] = {name: run(name, method, fields, None, sampling)
                                       for name, method, fields in CORE_METHODS}
    for mesh_name in MESHES:
        data, model = mesh_name.split("x")
        spec = f"data={data},model={model}"
        results["mesh"][mesh_name] = {}
        for mode, sampling in modes.items():
            if mode == "sampled" and mesh_name != "2x4":
                continue
            methods = CORE_METHODS + (OTHER_METHODS if mode == "greedy" and mesh_name == "2x4" else ())
            results["mesh"][mesh_name][mode] = {name: run(name, method, fields, spec, sampling)
                                                for name, method, fields in methods}
        jax.clear_caches()

    results["local_shapes"] = {}
    for mesh_name in MESHES:
        data, model = map(int, mesh_name.split("x"))
        w = sharding.shard_weights(target.weights, sharding.make_mesh(data, model))
        results["local_shapes"][mesh_name] = {"wq_heads": w.layers.wq.addressable_shards[0].data.shape[2],
                                              "embed_rows": w.embed.addressable_shards[0].data.shape[0]}

    results["acceptance"] = _acceptance_checks(sharding, target_probs, accept, verify_and_accept, DraftTree, jnp)

    refused = {}
    try:
        speculative_generate(target.weights, cfg, build_method("prompt-lookup", target).drafter, None, prompts[:6],
                             max_new_tokens=4, mesh=sharding.make_mesh(4, 2))
    except UserError as e:
        refused["batch"] = str(e)
    try:
        gqa = LoadedModel(config=tiny_config("llama", 4), weights=random_weights(tiny_config("llama", 4)),
                          tokenizer=None, source="tiny-llama-gqa")
        build_method("autoregressive", gqa, MethodOptions(mesh="model=8"))
    except UserError as e:
        refused["heads"] = str(e)
    try:
        build_method("autoregressive", target, MethodOptions(mesh="data=2,model=2"))
    except UserError as e:
        refused["devices"] = str(e)
    results["refused"] = refused
    return results


def _acceptance_checks(sharding, target_probs, accept, verify_and_accept, DraftTree, jnp) -> dict:
    """On a 1x8 mesh (the vocabulary in 8 slices of 32): p under several samplings, and the acceptance of a
    3-node tree with sampled draft probabilities, against one device with the same uniforms."""
    mesh = sharding.make_mesh(1, 8)
    rng = np.random.default_rng(1)
    b, t, v = 16, 3, 256
    logits = jnp.asarray(rng.normal(0, 2, (b, t + 1, v)).astype(np.float32))
    logits = logits.at[:, :, 7].set(logits[:, :, 200])  # ties across slices
    from jaxspec.sampling import SamplingConfig

    out = {"probs": {}, "same_outcome": {}, "rejections": 0, "acceptances": 0}
    vocab_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.DATA, None, sharding.MODEL))
    for case, sampling in {"greedy": SamplingConfig(), "t1": SamplingConfig(temperature=1.0),
                           "topk": SamplingConfig(temperature=0.7, top_k=5),
                           "topp": SamplingConfig(temperature=1.3, top_p=0.8),
                           "both": SamplingConfig(temperature=0.9, top_k=40, top_p=0.6)}.items():
        one = target_probs(logits, sampling)
        sharded = jax.jit(jax.shard_map(lambda x, s=sampling: target_probs(x, s, sharding.MODEL), mesh=mesh,
                                        in_specs=vocab_split.spec, out_specs=vocab_split.spec))(logits)
        out["probs"][case] = float(jnp.max(jnp.abs(sharded - one)))
        q = jax.nn.softmax(jnp.asarray(rng.normal(0, 2, (b, t, v)).astype(np.float32)), axis=-1)  # [b, t, v]
        q64 = np.asarray(q, np.float64)
        draft = jnp.asarray([[rng.choice(v, p=q64[i, j] / q64[i, j].sum()) for j in range(t)] for i in range(b)],
                            jnp.int32)  # [b, t], each node's token drawn from its q
        for kind, draft_probs in (("sampled", q), ("deterministic", None)):
            tree = DraftTree(tokens=draft, parents=jnp.broadcast_to(jnp.asarray([-1, 0, 0], jnp.int32), (b, t)),
                             valid=jnp.ones((b, t), bool), draft_probs=draft_probs)
            u, bu = jnp.asarray(rng.random((b, t)), jnp.float32), jnp.asarray(rng.random(b), jnp.float32)
            expected = accept(tree, one, u, bu)
            got = jax.jit(lambda tree, x, u, bu, s=sampling: verify_and_accept(tree, x, s, u, bu, mesh))(
                tree, logits, u, bu)
            out["same_outcome"][f"{case}/{kind}"] = all(
                bool(jnp.array_equal(getattr(got, f), getattr(expected, f))) for f in ("path", "tokens", "bonus"))
            out["rejections"] += int(jnp.sum(expected.num_accepted == 0))
            out["acceptances"] += int(jnp.sum(expected.num_accepted > 0))
    return out


if __name__ == "__main__" and "--child" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(_child()))
