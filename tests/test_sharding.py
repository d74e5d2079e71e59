"""Tests for jaxspec.sharding: sharded forwards on 8 fake CPU devices equal the one-device forward.

The multi-device checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` set before JAX initialises its
backend, which has already happened in a pytest process that ran other tests. So this file doubles as a script:
the module fixture runs `python tests/test_sharding.py --child` in a fresh process with that flag, the child runs
every mesh and prints one JSON line of results, and the tests here assert on them. The table and error checks
that need no devices run in-process (with `AbstractMesh`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import run_child
from jax.sharding import AbstractMesh, PartitionSpec

from jaxspec import sharding
from jaxspec.cache import init_cache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.model import LayerWeights, Weights

NUM_FAKE_DEVICES = 8
MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))  # (data, model)
# (architecture, kv heads, meshes): qwen2 (biases, untied head) on every mesh; llama (GQA, tied head) where its
# 4 kv heads split one per device, and on 1x8, which check_divisible must refuse; qwen3_moe (16 experts, 2 per
# token) with its experts split over the model axis (expert parallelism: 2 to 16 per device) on every mesh.
CASES = (("qwen2", 8, MESHES), ("llama", 4, ((1, 8), (2, 4))), ("qwen3_moe", 8, MESHES))
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------- tiny models


def tiny_config(architecture: str, num_kv_heads: int) -> ModelConfig:
    """8 query heads of dim 8 (d=64), f=128, V=256, 2 layers. qwen2 has biases and an untied head; the llama
    variant ties the output to the embedding so both output paths meet a vocabulary-sharded matrix; qwen3_moe has
    16 experts of width 16 in place of the MLP, 2 per token (a decoding step of 8 rows is 16 token-expert pairs: the
    gathered path; a prefill the grouped one)."""
    experts = {}
    if architecture == "qwen3_moe":
        experts = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    return ModelConfig(
        **experts,
        architecture=architecture,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=architecture == "llama",
        attention_bias=architecture == "qwen2",
        max_position_embeddings=128,
    )


def random_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """float32 weights in the `Weights` layout, scaled so activations and logits stay O(1).

    One `jax.random.normal` draw cut into pieces (one small compilation instead of one per weight).
    """
    L, d, hq, hkv, h, f, v = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    bias = cfg.attention_bias
    specs = {  # name: (shape, scale, offset)
        "attn_norm": ((L, d), 0.1, 1.0),
        "wq": ((L, d, hq, h), d**-0.5, 0.0),
        "wk": ((L, d, hkv, h), d**-0.5, 0.0),
        "wv": ((L, d, hkv, h), d**-0.5, 0.0),
        "wo": ((L, hq, h, d), (hq * h) ** -0.5, 0.0),
        "mlp_norm": ((L, d), 0.1, 1.0),
        **({"w_gate": ((L, d, f), d**-0.5, 0.0), "w_up": ((L, d, f), d**-0.5, 0.0),
            "w_down": ((L, f, d), f**-0.5, 0.0)} if not cfg.num_experts else {}),
        **({"router": ((L, d, cfg.num_experts), 1.0, 0.0),
            "expert_gate": ((L, cfg.num_experts, d, cfg.moe_intermediate_size), d**-0.5, 0.0),
            "expert_up": ((L, cfg.num_experts, d, cfg.moe_intermediate_size), d**-0.5, 0.0),
            "expert_down": ((L, cfg.num_experts, cfg.moe_intermediate_size, d), cfg.moe_intermediate_size**-0.5, 0.0)}
           if cfg.num_experts else {}),
        **(
            {"bq": ((L, hq, h), 0.1, 0.0), "bk": ((L, hkv, h), 0.1, 0.0), "bv": ((L, hkv, h), 0.1, 0.0)} if bias else {}
        ),
        "embed": ((v, d), 1.0, 0.0),
        "final_norm": ((d,), 0.1, 1.0),
        **({} if cfg.tie_word_embeddings else {"lm_head": ((d, v), d**-0.5, 0.0)}),
    }
    total = sum(math.prod(shape) for shape, _, _ in specs.values())
    flat = np.asarray(jax.random.normal(jax.random.key(seed), (total,), jnp.float32))
    arrays, start = {}, 0
    for name, (shape, scale, offset) in specs.items():
        size = math.prod(shape)
        arrays[name] = jnp.asarray(offset + scale * flat[start : start + size].reshape(shape))
        start += size
    top = {name: arrays.pop(name, None) for name in ("embed", "final_norm", "lm_head")}
    return Weights(layers=LayerWeights(**arrays), **top)


# ---------------------------------------------------------------------------------------------- in-process


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_logical_table_covers_every_field():
    assert {f.name for f in dataclasses.fields(LayerWeights)} == set(sharding.LAYER_WEIGHT_AXES)
    # head_screen: the single-device CPU layout's bfloat16 LM head (`greedy_tokens`), never placed on a mesh
    assert set(sharding.WEIGHT_AXES) | {"layers", "head_screen"} == {f.name for f in dataclasses.fields(Weights)}
    for axes in [*sharding.LAYER_WEIGHT_AXES.values(), *sharding.WEIGHT_AXES.values(), *sharding.CACHE_AXES.values()]:
        assert all(a in sharding.LOGICAL_AXIS_RULES for a in axes)
    assert set(sharding.LOGICAL_AXIS_RULES.values()) == {sharding.DATA, sharding.MODEL, None}


def test_weight_and_cache_shardings_mirror_the_pytrees():
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    cfg = tiny_config("llama", 4)  # tied embedding, no biases: those fields are None
    weights = _abstract(random_weights(cfg))
    specs = sharding.weight_shardings(weights, mesh)
    assert specs.lm_head is None and specs.layers.bq is None and specs.layers.q_norm is None
    assert specs.layers.wq.spec == PartitionSpec(None, None, "model", None)
    assert specs.layers.wo.spec == PartitionSpec(None, "model", None, None)
    assert specs.layers.w_down.spec == PartitionSpec(None, "model", None)
    assert specs.embed.spec == PartitionSpec("model", None)
    assert specs.final_norm.spec == PartitionSpec(None)
    assert jax.tree.structure(specs) == jax.tree.structure(weights)

    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 16))
    cspecs = sharding.cache_shardings(cache, mesh)
    assert cspecs.k.spec == PartitionSpec(None, "data", "model", None, None)
    assert cspecs.lengths.spec == PartitionSpec("data")


def test_weight_shardings_rejects_a_wrong_rank():
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    weights = _abstract(random_weights(tiny_config("qwen2", 8)))
    weights.layers.wq = jax.ShapeDtypeStruct((2, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="LayerWeights.wq"):
        sharding.weight_shardings(weights, mesh)


def test_make_mesh_wrong_device_count():
    n = len(jax.devices())
    with pytest.raises(UserError, match=f"needs {2 * n} devices, but {n} are available"):
        sharding.make_mesh(2, n)
    with pytest.raises(UserError, match="at least 1"):
        sharding.make_mesh(0, n)


def test_check_divisible_heads():
    cfg = tiny_config("llama", 4)
    sharding.check_divisible(cfg, 8, AbstractMesh((2, 4), (sharding.DATA, sharding.MODEL)))
    with pytest.raises(UserError) as e:
        sharding.check_divisible(cfg, 8, AbstractMesh((1, 8), (sharding.DATA, sharding.MODEL)))
    message = str(e.value)
    assert "model axis of size 8 does not divide num_kv_heads=4" in message
    assert "num_heads=" not in message  # 8 heads split fine; only the offending sizes are named
    assert "(1, 2, 4)" in message  # the sizes that would work
    assert "batch" not in message


def test_check_divisible_batch_and_heads_together():
    cfg = tiny_config("qwen2", 8)
    with pytest.raises(UserError, match=r"batch of 3 rows does not split over the mesh's data axis of size 2"):
        sharding.check_divisible(cfg, 3, AbstractMesh((2, 4), (sharding.DATA, sharding.MODEL)))
    odd = dataclasses.replace(cfg, num_heads=6, num_kv_heads=6)
    with pytest.raises(UserError) as e:
        sharding.check_divisible(odd, 3, AbstractMesh((2, 4), (sharding.DATA, sharding.MODEL)))
    assert "num_heads=6, num_kv_heads=6" in str(e.value) and "batch of 3 rows" in str(e.value)


# ---------------------------------------------------------------------------------------------- 8 devices


@pytest.fixture(scope="module")
def child_results():
    return run_child(__file__, NUM_FAKE_DEVICES, timeout=300)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])
def test_sharded_forward_matches_one_device(child_results, arch):
    runs = child_results["forward"][arch]
    _, kv_heads, meshes = next(c for c in CASES if c[0] == arch)
    expected = [f"{d}x{m}" for d, m in meshes if m <= kv_heads]
    assert sorted(runs) == sorted(expected)
    for name, r in runs.items():
        assert r["prefill_logits"] <= TOLERANCE, (name, r)
        assert r["decode_logits"] <= TOLERANCE, (name, r)
        assert r["cache"] <= TOLERANCE, (name, r)
        assert r["lengths_equal"], name
        assert r["weights_split"], name  # each device really holds only its slice


def test_too_many_model_shards_is_refused(child_results):
    # 4 kv heads cannot split 8 ways: check_divisible says so before anything is compiled.
    assert "num_kv_heads=4" in child_results["forward_refused"]["llama"]["1x8"]


def test_sharded_greedy_generation_matches(child_results):
    g = child_results["generate"]
    assert g["sharded"] == g["reference"]
    assert len(set(map(tuple, g["reference"]))) > 1  # rows differ: the check is not vacuous


def test_loading_onto_the_mesh_equals_sharding_a_plain_load(child_results):
    """`load_model(folder, mesh=...)` on a checkpoint split into 3 files: every array equals `shard_weights` of a
    plain load (float32 and bfloat16), with the same sharding, and each device holds only its slice."""
    r = child_results["load"]
    assert r["fields"] >= 10 and r["equal"] == r["fields"] and r["same_sharding"] == r["fields"]
    assert r["wq_shard_shape"] == [16, 256, 2, 32]  # 8 heads over the model axis of 4
    assert r["bfloat16_equal"] and r["bfloat16_dtype"] == "bfloat16" and r["stored_bfloat16_equal"]
    assert child_results["gguf_load_equal"]  # a quantized GGUF file, read a device's rows at a time


def test_loading_onto_the_mesh_holds_one_block_on_the_host(child_results):
    """Loading onto a (data 2, model 4) mesh reads each device's block of each field from the checkpoint on its own
    (a block replicated over the data axis once), so host memory stays near one block (a quarter of a field here),
    not one field or the model. Two measures: the bytes read from the checkpoint and not yet sent to a device never
    exceed the largest block (exact); and, coarser, tracemalloc's peak while loading (numpy's arrays and the
    checkpoint reader's buffers included) less what is still held at the end (on CPU the devices' buffers are host
    memory) stays within 4 blocks, one field: 2.3-3.2 blocks measured (the reader copies each block it returns),
    against 12 for jaxspec's loader before, which read a whole field at a time (and the whole model before that)."""
    r = child_results["load"]
    assert r["read_bytes"] == r["model_bytes"], r  # every byte of the checkpoint read once
    assert r["largest_block_bytes"] * 4 <= r["largest_field_bytes"], r
    assert 0 < r["most_read_ahead_bytes"] <= r["largest_block_bytes"], r
    assert r["peak_host_bytes"] - r["held_host_bytes"] <= 4 * r["largest_block_bytes"] <= r["largest_field_bytes"], r


# ---------------------------------------------------------------------------------------------- child process


def _save_split_checkpoint(folder, num_layers=16, d=256, vocab=4096, heads=8, head_dim=32, dtype=np.float32) -> int:
    """A Llama-shaped Hugging Face folder (tied embedding, F = d) with its tensors split over 3 safetensors files
    and an index, as large models ship, stored in `dtype` (the same values for any dtype); returns its bytes."""
    import os

    from safetensors.numpy import save_file

    config = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "tiny-llama3", "config.json")))
    config.update(hidden_size=d, intermediate_size=d, num_hidden_layers=num_layers, num_attention_heads=heads,
                  num_key_value_heads=heads, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=True)
    os.makedirs(folder, exist_ok=True)
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    rng = np.random.default_rng(3)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, d), np.float32),
               "model.norm.weight": 1 + 0.1 * rng.standard_normal(d, np.float32)}
    shapes = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (heads * head_dim, d),
              "self_attn.k_proj": (heads * head_dim, d), "self_attn.v_proj": (heads * head_dim, d),
              "self_attn.o_proj": (d, heads * head_dim), "mlp.gate_proj": (d, d), "mlp.up_proj": (d, d),
              "mlp.down_proj": (d, d)}
    for i in range(num_layers):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = (0.05 * rng.standard_normal(shape, np.float32)
                                                          + (1.0 if len(shape) == 1 else 0.0))
    tensors = {name: t.astype(dtype) for name, t in tensors.items()}
    names = sorted(tensors)
    weight_map = {}
    for part in range(3):
        file = f"model-{part + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in names[part::3]}, os.path.join(folder, file))
        weight_map.update({n: file for n in names[part::3]})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(folder, "model.safetensors.index.json"),
                                                              "w"))
    return sum(t.nbytes for t in tensors.values())


def _load_onto_mesh() -> dict:
    """load_model(..., mesh=) against shard_weights(load_model(...)), the bytes it reads from the checkpoint, and the
    most host memory it holds while loading (tracemalloc, which numpy reports its arrays to)."""
    import tempfile
    import tracemalloc

    from checkpoint_reads import counting_checkpoint_reads

    from jaxspec import load_model

    folder = tempfile.mkdtemp(prefix="jaxspec-split-")
    model_bytes = _save_split_checkpoint(folder)
    mesh = sharding.make_mesh(2, 4)
    plain = load_model(folder, with_tokenizer=False).weights  # first: what a first load sets up is not measured
    tracemalloc.start()
    try:
        with counting_checkpoint_reads() as count:
            on_mesh = load_model(folder, with_tokenizer=False, mesh=mesh).weights
        held_host_bytes, peak_host_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    reference = sharding.shard_weights(plain, mesh)
    pairs = [(a, b) for a, b in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(reference), strict=True)]
    bf16 = load_model(folder, dtype=jnp.bfloat16, with_tokenizer=False, mesh=mesh).weights
    bf16_ref = load_model(folder, dtype=jnp.bfloat16, with_tokenizer=False).weights
    # a checkpoint stored in bfloat16, loaded in bfloat16 (read as stored, never widened): the float32 load, rounded
    bf16_folder = folder + "-bf16"
    _save_split_checkpoint(bf16_folder, dtype=jnp.bfloat16)
    stored_bf16 = load_model(bf16_folder, dtype=jnp.bfloat16, with_tokenizer=False, mesh=mesh).weights
    return {
        "fields": len(pairs),
        "equal": sum(bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in pairs),
        "same_sharding": sum(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in pairs),
        "wq_shard_shape": list(on_mesh.layers.wq.addressable_shards[0].data.shape),
        "bfloat16_equal": all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                              for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(bf16_ref), strict=True)),
        "bfloat16_dtype": str(bf16.layers.wq.dtype),
        "stored_bfloat16_equal": all(
            np.array_equal(np.asarray(a, np.float32), np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32))
            for a, b in zip(jax.tree.leaves(stored_bf16), jax.tree.leaves(plain), strict=True)),
        "read_bytes": count["read"],
        "most_read_ahead_bytes": count["most_ahead"],
        "peak_host_bytes": peak_host_bytes,
        "held_host_bytes": held_host_bytes,
        "model_bytes": model_bytes,
        "largest_field_bytes": max(x.nbytes for x in jax.tree.leaves(plain)),
        "largest_block_bytes": max(s.data.nbytes for x in jax.tree.leaves(on_mesh) for s in x.addressable_shards),
    }



def _child() -> dict:
    """Runs in a fresh process with 8 fake CPU devices; returns JSON-able results."""
    from jaxspec.generate import decode_step, generate_tokens, prefill

    assert len(jax.devices()) == NUM_FAKE_DEVICES, jax.devices()
    # Partitioning, not XLA's CPU code generation, is under test: skipping the backend's expensive passes halves
    # the compile time of the ~10 programs below, and the one-device references are compiled the same way.
    jax.config.update("jax_disable_most_optimizations", True)
    batch, width, cache_size = 8, 16, 32
    rng = np.random.default_rng(0)
    prompt_lengths = np.array([16, 5, 9, 1, 12, 16, 3, 7], np.int32)
    tokens = rng.integers(0, 256, (batch, width)).astype(np.int32)
    next_tokens = rng.integers(0, 256, (batch,)).astype(np.int32)

    def prefill_then_decode(weights, cache, tokens, prompt_lengths, next_tokens, *, cfg, mesh=None):
        # tokens [B, P], prompt_lengths [B], next_tokens [B] -> (last prompt logits [B, V], logits [B, V], cache);
        # with a mesh both forwards are the tensor-parallel shard_map of jaxspec.sharding.forward_on_mesh
        last, _, cache = prefill(weights, cfg, tokens, prompt_lengths, cache, mesh)
        logits, cache = decode_step(weights, cfg, next_tokens, cache, jnp.ones(tokens.shape[:1], jnp.bool_), mesh)
        return last, logits, cache

    def diff(a, b):  # max |a - b| relative to the reference's scale (tied llama logits reach ~30)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))

    results = {"forward": {}, "forward_refused": {}}
    for arch, kv_heads, meshes in CASES:
        cfg = tiny_config(arch, kv_heads)
        weights = jax.tree.map(np.asarray, random_weights(cfg))  # host arrays: device_put slices without compiling
        cache = jax.tree.map(np.asarray, init_cache(cfg, batch, cache_size))
        args = (tokens, prompt_lengths, next_tokens)
        ref = jax.jit(functools.partial(prefill_then_decode, cfg=cfg))(weights, cache, *args)
        results["forward"][arch], results["forward_refused"][arch] = {}, {}
        for data, model in meshes:
            name = f"{data}x{model}"
            mesh = sharding.make_mesh(data, model)
            try:
                sharding.check_divisible(cfg, batch, mesh)
            except UserError as e:
                results["forward_refused"][arch][name] = str(e)
                continue
            w_sh, c_sh = sharding.weight_shardings(weights, mesh), sharding.cache_shardings(cache, mesh)
            rows1, rows2 = sharding.batch_sharding(mesh, 1), sharding.batch_sharding(mesh, 2)
            step = jax.jit(
                functools.partial(prefill_then_decode, cfg=cfg, mesh=mesh),
                in_shardings=(w_sh, c_sh, rows2, rows1, rows1),
                out_shardings=(
                    sharding.logical_sharding(mesh, ("batch", "vocab")),
                    sharding.logical_sharding(mesh, ("batch", "vocab")),
                    c_sh,
                ),
            )
            sharded_weights = sharding.shard_weights(weights, mesh)
            wq = sharded_weights.layers.wq
            split = wq.addressable_shards[0].data.shape == (2, 64, 8 // model, 8)
            embed_split = sharded_weights.embed.addressable_shards[0].data.shape == (256 // model, 64)
            if cfg.num_experts:  # each device holds E / model experts of every layer, and every router
                experts = sharded_weights.layers.expert_gate.addressable_shards[0].data.shape
                router = sharded_weights.layers.router.addressable_shards[0].data.shape
                split = split and experts == (2, cfg.num_experts // model, 64, 16) and router == (2, 64, 16)
            prefill_logits, decode_logits, out_cache = step(sharded_weights, sharding.shard_cache(cache, mesh), *args)
            assert out_cache.k.sharding.is_equivalent_to(c_sh.k, out_cache.k.ndim)
            results["forward"][arch][name] = {
                "prefill_logits": diff(prefill_logits, ref[0]),
                "decode_logits": diff(decode_logits, ref[1]),
                "cache": max(diff(out_cache.k, ref[2].k), diff(out_cache.v, ref[2].v)),
                "lengths_equal": bool(np.array_equal(out_cache.lengths, ref[2].lengths)),
                "weights_split": bool(split and embed_split),
            }

    # Greedy generation through the library's own jitted loop, with weights and prompts placed on a 2x4 mesh.
    cfg = tiny_config("qwen2", 8)
    weights = jax.tree.map(np.asarray, random_weights(cfg, seed=1))
    mesh = sharding.make_mesh(2, 4)
    rows = 4
    kwargs = {"cfg": cfg, "max_new_tokens": 8, "cache_size": cache_size}
    ref_out, _ = generate_tokens(
        weights, tokens=tokens[:rows], prompt_lengths=prompt_lengths[:rows], rng=jax.random.key(0), **kwargs
    )
    sharding.check_divisible(cfg, rows, mesh)
    sh_out, _ = generate_tokens(
        sharding.shard_weights(weights, mesh),
        tokens=jax.device_put(tokens[:rows], sharding.batch_sharding(mesh, 2)),
        prompt_lengths=jax.device_put(prompt_lengths[:rows], sharding.batch_sharding(mesh, 1)),
        rng=jax.device_put(jax.random.key(0), sharding.replicated(mesh)),
        **kwargs,
    )
    results["generate"] = {"reference": np.asarray(ref_out).tolist(), "sharded": np.asarray(sh_out).tolist()}
    results["load"] = _load_onto_mesh()
    results["gguf_load_equal"] = _load_gguf_onto_mesh()
    return results


def _load_gguf_onto_mesh() -> bool:
    """The real SmolLM2-135M GGUF (Q4_1: each device's rows dequantized on their own; Q and K rows un-permuted per
    head) loaded onto a model axis of 3 devices equals `shard_weights` of a plain load, with the same shardings."""
    from jaxspec import load_model

    mesh = sharding.make_mesh(1, 3, devices=jax.devices()[:3])  # 9 query and 3 key-value heads
    on_mesh = load_model("smollm2-135m", with_tokenizer=False, mesh=mesh).weights
    reference = sharding.shard_weights(load_model("smollm2-135m", with_tokenizer=False).weights, mesh)
    return all(np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
               for a, b in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(reference), strict=True))


if __name__ == "__main__" and "--child" in sys.argv:
    print(json.dumps(_child()))
