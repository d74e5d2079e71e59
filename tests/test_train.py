"""Drafter training end to end on a tiny target: Medusa trained from regenerated data, exact resume,
data parallelism on 8 fake devices, checkpoints refused for another target, greedy Medusa equals autoregressive."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec.config_files import from_dict, to_dict
from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.loading import load_model
from jaxspec.methods import MethodOptions, build_method
from jaxspec.training.config import TrainConfig

TINY = fixture_path("tiny-llama3")


def _config(data_path, out_dir, **run):
    return from_dict(TrainConfig, {
        "method": "medusa", "target": TINY, "dtype": "float32",
        "data": {"path": data_path, "seq_len": 32, "eval_holdout": 4},
        "optim": {"learning_rate": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
        "loss": {"kind": "forward_kl", "position_decay": 0.8},
        "run": {"steps": 6, "batch_size": 4, "seed": 0, "out_dir": out_dir, "save_every": 1, "keep_checkpoints": 2,
                "eval_every": 3, "eval_prompts": 4, "log_every": 1, **run},
        "drafter": {"num_heads": 2, "choices": [[0], [1], [0, 0]], "positions_per_row": 8},
    })


def test_training_produces_a_drafter_and_logs(tiny_data, tmp_path):
    from jaxspec.training.distill import train

    target, data = tiny_data
    summary = train(_config(data, str(tmp_path / "run")), progress=False)
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))
    # on a fixed batch, every position: the trained heads are closer to the target than the initial ones
    from jaxspec.data import RegeneratedDataset
    from jaxspec.drafters.medusa import init_medusa_params, medusa_loss
    from jaxspec.training.distill import target_features

    batch = next(RegeneratedDataset(data).batches(16, 32, seed=1))
    feats = target_features(target.weights, target.config, jax.numpy.asarray(batch["tokens"]), ())

    def fixed_loss(params):
        return float(medusa_loss(params, target.weights, target.config, feats.last_hidden, batch["loss_mask"],
                                 jax.random.key(0), positions_per_row=0)[0])

    assert fixed_loss(summary["params"]) < fixed_loss(init_medusa_params(target.config, 2))
    assert any("eval_tau" in r for r in records) and all(r["tokens_per_second"] > 0 for r in records if "loss" in r)
    assert (run / "loss.png").stat().st_size > 1000
    # the shipped drafter loads for this target and decodes exactly like autoregressive decoding
    method = build_method("medusa", target, MethodOptions(drafter=summary["drafter"]))
    prompts = [[5, 9, 33, 2], list(range(40, 58))]
    expected = generate(target.weights, target.config, prompts, max_new_tokens=16, eos_ids=()).token_ids
    assert method.generate(prompts, max_new_tokens=16, eos_ids=()).token_ids == expected


def test_resumed_training_equals_uninterrupted(tiny_data, tmp_path):
    from jaxspec.training.distill import train

    _, data = tiny_data
    whole = train(_config(data, str(tmp_path / "whole"), eval_every=0), progress=False)
    part = train(_config(data, str(tmp_path / "split"), eval_every=0), progress=False, stop_after=4)
    assert part["steps"] == 4 and "drafter" not in part
    resumed = train(_config(data, str(tmp_path / "split"), eval_every=0), progress=False)
    assert resumed["steps"] == 6 and resumed["data_position"] == whole["data_position"]
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_drafter_for_another_target_is_refused(tiny_data, tmp_path):
    from jaxspec.training.distill import train

    _, data = tiny_data
    summary = train(_config(data, str(tmp_path / "run"), steps=2, eval_every=0), progress=False)
    other = load_model(fixture_path("tiny-qwen2"))
    with pytest.raises(UserError, match="trained for target"):
        build_method("medusa", other, MethodOptions(drafter=summary["drafter"]))


def test_a_run_can_start_from_a_trained_drafter(tiny_data, tmp_path):
    from jaxspec.training.distill import train

    _, data = tiny_data
    first = train(_config(data, str(tmp_path / "first"), steps=2, eval_every=0), progress=False)
    # one step of a fine-tuning run at a near-zero learning rate stays at the first run's parameters
    config = _config(data, str(tmp_path / "second"), steps=1, eval_every=0, init_from=first["drafter"])
    plain = json.loads(json.dumps(_to_plain(config)))
    plain["optim"].update(learning_rate=1e-12, warmup_steps=0, schedule="constant")
    second = train(from_dict(TrainConfig, plain), progress=False)
    for a, b in zip(jax.tree.leaves(first["params"]), jax.tree.leaves(second["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-8)
    fresh = train(from_dict(TrainConfig, {**plain, "run": {**plain["run"], "init_from": None,
                                                           "out_dir": str(tmp_path / "fresh")}}), progress=False)
    assert any(not np.allclose(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(first["params"]), jax.tree.leaves(fresh["params"]), strict=True))
    # a drafter trained with other settings is refused before any step
    plain["drafter"]["choices"] = [[0], [1]]
    plain["run"]["out_dir"] = str(tmp_path / "third")
    with pytest.raises(UserError, match="other drafter settings.*choices"):
        train(from_dict(TrainConfig, plain), progress=False)


def test_data_from_another_target_is_refused(tiny_data, tmp_path):
    from jaxspec.training.distill import train

    _, data = tiny_data
    config = _config(data, str(tmp_path / "run"))
    config = from_dict(TrainConfig, {**json.loads(json.dumps(_to_plain(config))), "target": fixture_path("tiny-qwen2")})
    with pytest.raises(UserError, match="another target"):
        train(config, progress=False)


def _to_plain(config):
    from jaxspec.config_files import to_dict

    return to_dict(config)


def test_unknown_config_key_is_refused_by_the_cli(tmp_path, capsys):
    from jaxspec.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("method: medusa\ndata:\n  path: x\nrun:\n  stepz: 3\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "run.stepz" in err and "run.steps" in err


_DP_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from jaxspec.config_files import from_dict
from jaxspec.training.config import TrainConfig, make_optimizer
from jaxspec.data import RegeneratedDataset
from jaxspec.loading import load_model
from jaxspec.sharding import make_mesh
from jaxspec.training.distill import _shardings, make_train_step, trainable_for

config = from_dict(TrainConfig, json.loads({config!r}))
target = load_model(config.target)
trainable = trainable_for("medusa")
from jaxspec.config_files import from_dict as fd
mcfg = fd(trainable.config_cls, dict(config.drafter))
params = trainable.init_params(mcfg, target, jax.random.key(0))
params = jax.tree.map(lambda x: x + 0.01, params)
opt = make_optimizer(config.optim, 10)
batch = next(RegeneratedDataset(config.data.path).batches(8, 32, 0))
out = {{}}
for data_axis in (1, 8):
    mesh = make_mesh(data=data_axis, model=1, devices=jax.devices()[:data_axis])
    rep, sharded = _shardings(mesh)
    step = jax.jit(make_train_step(trainable, mcfg, target.config, config.loss, opt, ()),
                   in_shardings=(rep, rep, rep, sharded, sharded, rep), out_shardings=(rep, rep, rep))
    p, _, m = step(params, opt.init(params), target.weights, jnp.asarray(batch["tokens"]),
                   jnp.asarray(batch["loss_mask"]), jax.random.key(3))
    out[data_axis] = [np.asarray(x).tolist() for x in jax.tree.leaves(p)] + [float(m["loss"])]
print(json.dumps(out))
"""


def test_data_parallel_step_equals_single_device(tiny_data, tmp_path):
    from jaxspec.config_files import to_dict

    _, data = tiny_data
    config = json.dumps(to_dict(_config(data, str(tmp_path / "run"))))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _DP_SCRIPT.format(root=root, tests=os.path.join(root, "tests"), config=config)
    from fake_devices import fake_device_env

    env = fake_device_env(8)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, eight = out["1"], out["8"]
    for a, b in zip(one, eight, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


_SPLIT_TARGET_SCRIPT = """
import json, sys
import jax, numpy as np
sys.path.insert(0, {root!r})
from jaxspec.config_files import from_dict
from jaxspec.training.config import TrainConfig
from jaxspec.training.distill import train
import jaxspec.loading

real_load, placed = jaxspec.loading.load_model, []

def load_model(*args, **kwargs):  # records where the target's query weights were placed
    model = real_load(*args, **kwargs)
    placed.append(model.weights.layers.wq.addressable_shards[0].data.shape)
    return model

jaxspec.loading.load_model = load_model
raw = json.loads({config!r})
out = {{"wq_shards": placed}}
for data_axis, model_axis in ((1, 1), (2, 2)):
    run = dict(raw, mesh={{"data": data_axis, "model": model_axis}},
               run=dict(raw["run"], out_dir=raw["run"]["out_dir"] + f"-{{data_axis}}x{{model_axis}}"))
    summary = train(from_dict(TrainConfig, run), progress=False)
    if model_axis > 1:
        assert len(jax.tree.leaves(summary["params"])[0].sharding.device_set) == 4, "the drafter spans the mesh"
    out[f"{{data_axis}}x{{model_axis}}"] = [np.asarray(x).tolist() for x in jax.tree.leaves(summary["params"])]
print(json.dumps(out))
"""


def test_training_with_the_target_split_over_the_model_axis_equals_one_device(tiny_data, tmp_path):
    """mesh.model: the frozen target loaded onto its shards (tensor parallel over 2 devices) while the drafter trains
    data-parallel over 2 more; 3 steps through `train` end with the parameters of the one-device run."""
    from jaxspec.config_files import to_dict

    _, data = tiny_data
    config = json.dumps(to_dict(_config(data, str(tmp_path / "run"), steps=3, eval_every=0)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from fake_devices import fake_device_env

    proc = subprocess.run([sys.executable, "-c", _SPLIT_TARGET_SCRIPT.format(root=root, config=config)],
                          capture_output=True, text=True, env=fake_device_env(4), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (one, split), heads = out["wq_shards"], 4  # [L, d, heads, h]: the 2x2 run holds half the heads per device
    assert one[2] == heads and split[2] == heads // 2 and one[:2] == split[:2]
    for a, b in zip(out["1x1"], out["2x2"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_untrained_medusa_is_greedy_exact(tiny_data):
    target, _ = tiny_data
    method = build_method("medusa", target, MethodOptions(drafter="untrained"))
    prompts = [[7, 8, 9], list(range(10, 30))]
    expected = generate(target.weights, target.config, prompts, max_new_tokens=14, eos_ids=()).token_ids
    result = method.generate(prompts, max_new_tokens=14, eos_ids=())
    assert result.token_ids == expected


def test_cached_features_train_like_features_computed_in_the_step(tiny_data, tmp_path):
    """data.cache_features: the target runs once over the data set; the run ends with the same parameters."""
    from jaxspec.config_files import to_dict
    from jaxspec.training.distill import train

    _, data = tiny_data
    plain = train(_config(data, str(tmp_path / "plain"), steps=3, eval_every=0), progress=False)
    raw = to_dict(_config(data, str(tmp_path / "cached"), steps=3, eval_every=0))
    raw["data"]["cache_features"] = True
    cached = train(from_dict(TrainConfig, raw), progress=False)
    assert (tmp_path / "cached" / "features" / "last_hidden.npy").exists()
    for a, b in zip(jax.tree.leaves(plain["params"]), jax.tree.leaves(cached["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_spd_drafter_trains_through_the_pipeline_and_decodes_exactly(tiny_data, tmp_path):
    """`jaxspec train` for SPD on the tiny target: the loss falls, the evaluation reports L'acc, and the saved drafter
    loads as `--method spd` and decodes exactly like autoregressive decoding (3 stages of one layer)."""
    from jaxspec.training.distill import train

    target, data = tiny_data
    config = _config(data, str(tmp_path / "spd"), steps=12, eval_every=12)
    config = from_dict(TrainConfig, {**to_dict(config), "method": "spd", "loss": {"kind": "forward_kl"},
                                     "drafter": {"num_layers": 2, "draft_vocab_size": 64}})
    summary = train(config, progress=False)
    records = [json.loads(line) for line in (tmp_path / "spd" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert all(r["num_stages"] == 3 for r in records if "loss" in r)
    assert any(r.get("eval_tau", 0) >= 1.0 for r in records)  # L'acc of the pipeline on held-out prompts
    method = build_method("spd", target, MethodOptions(drafter=summary["drafter"]))
    prompts = [[5, 9, 33, 2], list(range(40, 58))]
    expected = generate(target.weights, target.config, prompts, max_new_tokens=16, eos_ids=()).token_ids
    assert method.generate(prompts, max_new_tokens=16, eos_ids=()).token_ids == expected


def test_features_saved_at_regeneration_train_without_running_the_target(tiny_data, tmp_path, monkeypatch):
    """A regeneration with --feature-layers covering EAGLE-3's layers and the last one: training reads the saved
    features (the target's feature forward is never called) and its losses equal those of features computed inside
    the step on the same tokens, to the bfloat16 rounding of the saved features."""
    import jaxspec.training.distill as distill
    from jaxspec.config_files import to_dict
    from jaxspec.data import regenerate_ids
    from jaxspec.drafters.eagle import Eagle3Config

    target, plain_data = tiny_data
    rng = np.random.default_rng(0)  # the prompts of the tiny_data fixture
    prompts = [rng.integers(1, 256, size=int(rng.integers(4, 12))).tolist() for _ in range(20)]
    layers = Eagle3Config(draft_vocab_size=0).for_target(target.config).feature_layers
    saved = str(tmp_path / "regen-features")
    regenerate_ids(target, prompts, saved, max_prompt_tokens=16, max_new_tokens=20, batch_size=5, shard_size=10,
                   progress=False, feature_layers=(*layers, target.config.num_layers - 1))

    def eagle3(data, out):
        raw = to_dict(_config(data, str(tmp_path / out), steps=3, eval_every=0))
        raw.update(method="eagle3", drafter={"draft_vocab_size": 0, "ttt_steps": 2, "depth": 2, "top_k": 2,
                                             "num_nodes": 4})
        return from_dict(TrainConfig, raw)

    distill.train(eagle3(plain_data, "in-step"), progress=False)

    def no_target(*args, **kwargs):
        raise AssertionError("the target ran although the regeneration saved its features")

    monkeypatch.setattr(distill, "target_features", no_target)
    distill.train(eagle3(saved, "saved"), progress=False)
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl")] for run in
              ("in-step", "saved")]
    assert len(losses[0]) == 3 and losses[0] != losses[1]  # not the same numbers by accident: features rounded
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-2)
