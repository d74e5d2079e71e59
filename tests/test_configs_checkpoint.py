"""Training configs (YAML -> frozen dataclasses, overrides, refusals), the optimizer, and both checkpoint kinds."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.checkpoint import (
    DRAFTER_META_FILE,
    DRAFTER_PARAMS_FILE,
    TrainCheckpointer,
    load_drafter,
    save_drafter,
)
from jaxspec.config_files import apply_overrides, dump_config, from_dict, load_config, parse_yaml, to_dict
from jaxspec.errors import UserError
from jaxspec.training.config import OptimConfig, TrainConfig, make_optimizer, make_schedule

YAML = """
method: medusa
target: smollm2-135m
data:
  path: data/smollm2
  seq_len: 512
optim:
  learning_rate: 3e-4
  warmup_steps: 10
  schedule: linear
loss:
  kind: forward_kl
  position_decay: 0.8
run:
  steps: 100
  batch_size: 4
drafter:
  num_heads: 4
  sizes: [1, 2]
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "medusa.yaml"
    path.write_text(YAML)
    return path


# ---------------------------------------------------------------------------------------------- configs


def test_load_config_reads_every_section(config_file):
    cfg = load_config(config_file, TrainConfig)
    assert cfg.method == "medusa" and cfg.data.seq_len == 512 and cfg.data.eval_holdout == 0.01
    assert cfg.optim.learning_rate == pytest.approx(3e-4) and isinstance(cfg.optim.learning_rate, float)
    assert cfg.loss.position_decay == 0.8 and cfg.loss.gamma is None
    assert cfg.run.steps == 100 and cfg.mesh.data == 1
    assert cfg.drafter == {"num_heads": 4, "sizes": [1, 2]}
    hash(cfg)  # frozen and hashable despite the free-form drafter mapping
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.method = "eagle3"


@pytest.mark.parametrize(
    "data, key, suggestion",
    [
        ({"methd": "medusa"}, "'methd'", "'method'"),
        ({"optim": {"learnig_rate": 1.0}}, "'optim.learnig_rate'", "'optim.learning_rate'"),
        ({"run": {"batch_sise": 2}}, "'run.batch_sise'", "'run.batch_size'"),
    ],
)
def test_unknown_key_is_refused_with_path_and_suggestion(data, key, suggestion):
    base = {"method": "medusa", "data": {"path": "d"}}
    merged = {**base, **data}
    with pytest.raises(UserError) as e:
        from_dict(TrainConfig, merged)
    msg = str(e.value)
    assert f"Unknown config key {key}" in msg and f"Did you mean {suggestion}?" in msg
    assert "Valid keys" in msg


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(UserError, match=r"'mesh\.zzz'\. Valid keys under 'mesh': data, model\.$"):
        from_dict(TrainConfig, {"method": "m", "data": {"path": "d"}, "mesh": {"zzz": 1}})


@pytest.mark.parametrize(
    "section, value, pattern",
    [
        ({"run": {"steps": "ten"}}, None, r"'run\.steps' must be an integer, got a string \('ten'\)"),
        ({"run": {"steps": 1.5}}, None, r"'run\.steps' must be an integer"),
        ({"run": {"steps": True}}, None, r"'run\.steps' must be an integer"),
        ({"optim": {"learning_rate": "fast"}}, None, r"'optim\.learning_rate' must be a number"),
        ({"optim": {"grad_clip": [1]}}, None, r"'optim\.grad_clip' must be a number or null"),
        ({"optim": {"schedule": "cosin"}}, None, r"'optim\.schedule' must be one of 'linear', 'cosine', 'constant'"),
        ({"data": "somewhere"}, None, r"'data' must be a mapping"),
        ({"drafter": [1, 2]}, None, r"'drafter' must be a mapping"),
    ],
)
def test_wrong_type_is_refused(section, value, pattern):
    data = {"method": "medusa", "data": {"path": "d"}, **section}
    with pytest.raises(UserError, match=pattern):
        from_dict(TrainConfig, data)


def test_invalid_values_and_missing_keys_are_refused():
    base = {"method": "medusa", "data": {"path": "d"}}
    with pytest.raises(UserError, match="run.steps must be positive"):
        from_dict(TrainConfig, {**base, "run": {"steps": 0}})
    with pytest.raises(UserError, match="set only one"):
        from_dict(TrainConfig, {**base, "loss": {"position_decay": 0.8, "gamma": 0.5}})
    with pytest.raises(UserError, match="multiple of mesh.data"):
        from_dict(TrainConfig, {**base, "run": {"batch_size": 6}, "mesh": {"data": 4}})
    with pytest.raises(UserError, match="Missing config key 'data'"):
        from_dict(TrainConfig, {"method": "medusa"})
    with pytest.raises(UserError, match="Missing config key 'data.path'"):
        from_dict(TrainConfig, {"method": "medusa", "data": {}})


def test_nested_optional_and_tuple_fields():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Inner:
        sizes: tuple[int, ...] = (1,)
        pair: tuple[float, float] = (0.0, 1.0)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Outer:
        inner: Inner | None = None
        name: str = "x"

    assert from_dict(Outer, {}) == Outer()
    got = from_dict(Outer, {"inner": {"sizes": [3, 4], "pair": [1, 2]}})
    assert got.inner == Inner(sizes=(3, 4), pair=(1.0, 2.0))
    assert from_dict(Outer, to_dict(got)) == got
    with pytest.raises(UserError, match=r"'inner\.sizes\[1\]' must be an integer"):
        from_dict(Outer, {"inner": {"sizes": [3, "4"]}})
    with pytest.raises(UserError, match=r"Unknown config key 'inner\.size'\. Did you mean 'inner\.sizes'"):
        from_dict(Outer, {"inner": {"size": [3]}})


def test_overrides(config_file):
    cfg = load_config(config_file, TrainConfig, overrides=["optim.learning_rate=1e-3", "run.steps=7",
                                                           "loss.position_decay=null", "drafter.num_heads=2",
                                                           "mesh.data=2", "target=path/to/model.gguf"])
    assert cfg.optim.learning_rate == pytest.approx(1e-3) and cfg.run.steps == 7 and cfg.loss.position_decay is None
    assert cfg.drafter["num_heads"] == 2 and cfg.mesh.data == 2 and cfg.target == "path/to/model.gguf"
    with pytest.raises(UserError, match=r"Unknown config key 'optim\.warmup'\. Did you mean 'optim\.warmup_steps'"):
        load_config(config_file, TrainConfig, overrides=["optim.warmup=5"])
    with pytest.raises(UserError, match="must look like key.sub=value"):
        apply_overrides({}, ["optim.learning_rate"])
    with pytest.raises(UserError, match="not a mapping"):
        apply_overrides({"run": 3}, ["run.steps=2"])
    data = {"a": {"b": 1}}
    assert apply_overrides(data, ["a.c=[1, 2]"]) == {"a": {"b": 1, "c": [1, 2]}} and data == {"a": {"b": 1}}


def test_load_config_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", TrainConfig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [unclosed\n")
    with pytest.raises(UserError, match="is not valid YAML"):
        load_config(bad, TrainConfig)
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(bad, TrainConfig)


def test_config_round_trip(config_file, tmp_path):
    cfg = load_config(config_file, TrainConfig)
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg
    assert from_dict(TrainConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again, TrainConfig) == cfg
    assert parse_yaml("x: 1e-4")["x"] == pytest.approx(1e-4)  # YAML 1.2 floats


# ---------------------------------------------------------------------------------------------- optimizer


def test_warmup_then_decay_schedules():
    for kind, mid in (("linear", 0.5), ("cosine", 0.5), ("constant", 1.0)):
        optim = OptimConfig(learning_rate=1.0, warmup_steps=10, schedule=kind)
        lr = make_schedule(optim, 110)
        got = [float(lr(s)) for s in (0, 5, 10, 60, 110)]
        end = 1.0 if kind == "constant" else 0.0
        np.testing.assert_allclose(got, [0.0, 0.5, 1.0, mid, end], atol=1e-6, err_msg=kind)
    lr = make_schedule(OptimConfig(learning_rate=2.0, warmup_steps=0, schedule="linear", final_lr_fraction=0.1), 10)
    np.testing.assert_allclose([float(lr(0)), float(lr(10))], [2.0, 0.2], atol=1e-6)
    with pytest.raises(UserError, match="longer than the run"):
        make_schedule(OptimConfig(warmup_steps=10), 5)


def test_gradient_clipping_bounds_the_global_norm():
    optim = OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="constant", grad_clip=0.5, b2=0.5)
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    grads = {"w": jnp.full((2, 3), 100.0), "b": jnp.full(3, -50.0)}

    @functools.partial(jax.jit, static_argnums=0)
    def grad_norm_seen_by_adam(clip):  # sqrt(nu / (1 - b2)) after one update is |g| as Adam saw it
        tx = make_optimizer(dataclasses.replace(optim, grad_clip=clip), 10)
        _, state = tx.update(grads, tx.init(params), params)
        nu = optax.tree_utils.tree_get(state, "nu")
        return jnp.sqrt(sum(jnp.sum(v / (1 - optim.b2)) for v in jax.tree.leaves(nu)))

    np.testing.assert_allclose(float(grad_norm_seen_by_adam(0.5)), 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(grad_norm_seen_by_adam(None)), float(optax.tree.norm(grads)), rtol=1e-5)


def test_grad_accumulation_equals_one_big_batch():
    """MultiSteps over 4 micro-batches of 2 rows equals plain AdamW on the 8-row batch (a quadratic loss)."""
    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.normal(size=(3, 8, 4)), jnp.float32), jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    loss = lambda p, xb, yb: jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)  # noqa: E731
    init = {"w": jnp.asarray(rng.normal(size=(4,)), jnp.float32), "b": jnp.zeros(())}
    base = OptimConfig(learning_rate=0.1, warmup_steps=1, schedule="cosine", weight_decay=0.0, grad_clip=1.0)

    def stepper(tx):
        @jax.jit
        def step(p, s, xb, yb):
            up, s = tx.update(jax.grad(loss)(p, xb, yb), s, p)
            return optax.apply_updates(p, up), s, up

        return step

    big_tx = make_optimizer(base, 3)
    big_step, p_big, s_big = stepper(big_tx), init, big_tx.init(init)
    for i in range(3):
        p_big, s_big, _ = big_step(p_big, s_big, x[i], y[i])

    acc_tx = make_optimizer(dataclasses.replace(base, grad_accum=4), 3)
    acc_step, p_acc, s_acc = stepper(acc_tx), init, acc_tx.init(init)
    for i in range(3):
        for j in range(4):
            p_acc, s_acc, up = acc_step(p_acc, s_acc, x[i, 2 * j:2 * j + 2], y[i, 2 * j:2 * j + 2])
            if j < 3:
                np.testing.assert_array_equal(np.asarray(up["w"]), 0.0)  # no update until the 4th micro-batch
    for k in init:
        np.testing.assert_allclose(np.asarray(p_acc[k]), np.asarray(p_big[k]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(p_big["w"]), np.asarray(init["w"]))


# ---------------------------------------------------------------------------------------------- training checkpoints


_TX = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.01), 10)


@functools.partial(jax.jit, static_argnums=1)
def _adamw_steps(params, steps):
    opt_state = _TX.init(params)
    for _ in range(steps):
        updates, opt_state = _TX.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


def _train_state(seed: int = 0, steps: int = 2):
    params = {"w": jnp.arange(12.0).reshape(3, 4) + seed, "b": jnp.ones(4) * seed, "scale": jnp.ones(())}
    params, opt_state = _adamw_steps(params, steps)
    return {"params": params, "opt_state": opt_state, "step": steps, "data_position": 40 + seed,
            "rng": jax.random.key(seed)}


def _assert_state_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert a["step"] == b["step"] and a["data_position"] == b["data_position"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_train_checkpoint_round_trip(tmp_path):
    state = _train_state(seed=3)
    saved = jax.tree.map(np.asarray, {k: v for k, v in state.items() if k != "rng"})
    abstract = jax.eval_shape(lambda: _train_state(seed=0))
    with TrainCheckpointer(tmp_path / "ck", save_every=1, keep=2, config={"method": "medusa"}) as ck:
        assert ck.latest_step() is None
        with pytest.raises(UserError, match="no finished training checkpoint"):
            ck.restore(abstract_state=abstract)
        assert ck.save(5, state)
        for leaf in jax.tree.leaves(state["params"]):  # as if donated to the next step: the save already copied
            leaf.delete()
        ck.wait_until_finished()
        got = ck.restore(abstract_state=abstract)
        assert ck.restore_metadata()["config"] == {"method": "medusa"}
    assert isinstance(got["opt_state"], type(abstract["opt_state"]))
    assert jax.random.key_impl(got["rng"]) == jax.random.key_impl(jax.random.key(0))
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(jax.random.key(3)))
    _assert_state_equal({**saved, "rng": jax.random.key(3)}, got)
    # Training continues identically from the restored optimizer state.
    update = jax.jit(lambda s, p: _TX.update(jax.tree.map(jnp.ones_like, p), s, p)[0])
    ref = _train_state(seed=3)
    jax.tree.map(np.testing.assert_array_equal, update(ref["opt_state"], ref["params"]),
                 update(got["opt_state"], got["params"]))


def test_train_checkpoint_interval_and_keep_last_k(tmp_path):
    state = _train_state(steps=1)
    with TrainCheckpointer(tmp_path / "ck", save_every=2, keep=2) as ck:
        saved = [s for s in range(1, 8) if ck.save(s, {**state, "step": s})]
        assert saved == [2, 4, 6]
        assert ck.save(7, {**state, "step": 7}, force=True)
        assert not ck.save(7, {**state, "step": 7}, force=True)  # already saved
        ck.wait_until_finished()
        assert ck.all_steps() == [6, 7] and ck.latest_step() == 7
        with pytest.raises(UserError, match=r"no checkpoint for step 2 .*steps there: 6, 7"):
            ck.restore(2, abstract_state=state)
        assert ck.restore(6, abstract_state=state)["step"] == 6
    assert sorted(os.listdir(tmp_path / "ck")) == ["6", "7"]


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    """A kill during a save leaves `<step>.orbax-checkpoint-tmp` (Orbax renames only finished steps)."""
    directory = tmp_path / "ck"
    good = _train_state(seed=1)
    with TrainCheckpointer(directory, save_every=1, keep=3) as ck:
        ck.save(4, good)
    # What a kill halfway through saving step 8 leaves: the temporary directory, partly written.
    partial = directory / "8.orbax-checkpoint-tmp"
    shutil.copytree(directory / "4", partial)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        (partial / name).unlink(missing_ok=True)
    for root, _, files in os.walk(partial / "state"):
        for f in files[: len(files) // 2]:
            os.remove(os.path.join(root, f))
    with TrainCheckpointer(directory, save_every=1, keep=3) as ck:
        assert ck.all_steps() == [4] and ck.latest_step() == 4
        _assert_state_equal(good, ck.restore(abstract_state=jax.eval_shape(lambda: _train_state())))
        assert ck.save(8, _train_state(seed=2))  # the same step saves cleanly over the leftovers
        ck.wait_until_finished()
        assert ck.all_steps() == [4, 8]
        _assert_state_equal(_train_state(seed=2), ck.restore(abstract_state=good))
    assert not partial.exists()


_KILLED_SAVE = """
import os, signal, sys, time
import jax.numpy as jnp
from jaxspec.checkpoint import TrainCheckpointer
d = sys.argv[1]
ck = TrainCheckpointer(d, save_every=1, keep=3)
ck.save(1, {"x": jnp.arange(4.0), "step": 1})
ck.wait_until_finished()
ck.save(2, {"x": jnp.ones((16, 1024, 1024)), "step": 2})  # 64 MB, written in the background
deadline = time.time() + 30
while not set(os.listdir(d)) & {"2", "2.orbax-checkpoint-tmp"} and time.time() < deadline:
    time.sleep(0.001)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_process_killed_while_saving_keeps_previous_checkpoint(tmp_path):
    """A real SIGKILL in the middle of an asynchronous save."""
    directory = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(directory)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    if (directory / "2").exists():
        pytest.skip("the save finished before the kill")
    assert (directory / "2.orbax-checkpoint-tmp").exists()
    with TrainCheckpointer(directory, save_every=1, keep=3) as ck:
        assert ck.all_steps() == [1]
        got = ck.restore(abstract_state={"x": jax.ShapeDtypeStruct((4,), jnp.float32), "step": 0})
    assert got["step"] == 1
    np.testing.assert_array_equal(got["x"], np.arange(4.0))


def test_restore_into_another_structure_is_a_user_error(tmp_path):
    with TrainCheckpointer(tmp_path / "ck") as ck:
        ck.save(1, _train_state())
        other = {**_train_state(), "params": {"w": jnp.zeros((5, 5))}}
        with pytest.raises(UserError, match="does not match this run's training state"):
            ck.restore(abstract_state=other)


# ---------------------------------------------------------------------------------------------- drafter checkpoints


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Heads:
    w: jax.Array  # [H, d, d]
    norms: list


def _drafter_params():
    rng = np.random.default_rng(0)
    return {"heads": _Heads(w=jnp.asarray(rng.normal(size=(2, 3, 3)), jnp.float32),
                            norms=[jnp.ones(3, jnp.bfloat16), jnp.zeros(3, jnp.bfloat16)]),
            "step": jnp.asarray(7, jnp.int32)}


def test_drafter_checkpoint_round_trip(tmp_path):
    params = _drafter_params()
    d = save_drafter(tmp_path / "drafter", method="medusa", drafter_config={"num_heads": 2, "sizes": [1, 2]},
                     params=params, target_fingerprint="abc123", target_source="smollm2-135m", extra={"tau": 2.5})
    assert sorted(os.listdir(d)) == [DRAFTER_META_FILE, DRAFTER_PARAMS_FILE]
    meta, got = load_drafter(d, expected_method="medusa", target_fingerprint="abc123",
                             abstract_params=jax.eval_shape(_drafter_params))
    assert meta["method"] == "medusa" and meta["config"] == {"num_heads": 2, "sizes": [1, 2]}
    assert meta["target"] == {"fingerprint": "abc123", "source": "smollm2-135m"} and meta["extra"] == {"tau": 2.5}
    assert {t["name"]: t["shape"] for t in meta["params"]["tensors"]} == {
        "heads/w": [2, 3, 3], "heads/norms/0": [3], "heads/norms/1": [3], "step": []}
    assert isinstance(got["heads"], _Heads) and got["heads"].norms[0].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, got, params)
    # Without a template: nested dicts and lists from the saved paths.
    _, plain = load_drafter(d)
    assert isinstance(plain["heads"], dict) and isinstance(plain["heads"]["norms"], list)
    np.testing.assert_array_equal(plain["heads"]["w"], params["heads"].w)
    # A template of another shape is refused.
    wrong = {**jax.eval_shape(_drafter_params), "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(UserError, match="does not fit this drafter's parameters .*missing extra"):
        load_drafter(d, abstract_params=wrong)


def test_drafter_for_another_target_or_method_is_refused(tmp_path):
    d = save_drafter(tmp_path / "drafter", method="medusa", drafter_config={}, params=_drafter_params(),
                     target_fingerprint="aaaa", target_source="smollm2-135m")
    with pytest.raises(UserError) as e:
        load_drafter(d, target_fingerprint="bbbb", target_source="qwen3.gguf")
    assert str(e.value) == ("This drafter was trained for target smollm2-135m (fingerprint aaaa), not for qwen3.gguf "
                            "(fingerprint bbbb); train one for this target or pass the right --model.")
    with pytest.raises(UserError, match="is a 'medusa' drafter, not 'eagle3'"):
        load_drafter(d, expected_method="eagle3")


def test_corrupt_or_missing_drafter_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_drafter(tmp_path / "none")
    d = save_drafter(tmp_path / "drafter", method="medusa", drafter_config={}, params=_drafter_params(),
                     target_fingerprint="aaaa", target_source="smollm2-135m")
    params_file = os.path.join(d, DRAFTER_PARAMS_FILE)
    blob = open(params_file, "rb").read()
    with open(params_file, "wb") as f:  # truncated
        f.write(blob[:-7])
    with pytest.raises(UserError, match="is corrupt: params.safetensors does not match the checksum"):
        load_drafter(d)
    os.remove(params_file)
    with pytest.raises(UserError, match="params.safetensors is missing"):
        load_drafter(d)
    meta_file = os.path.join(d, DRAFTER_META_FILE)
    with open(meta_file, "w") as f:
        f.write('{"format": "jaxspec-drafter", "method": ')
    with pytest.raises(UserError, match="is corrupt: jaxspec_drafter.json cannot be read"):
        load_drafter(d)
    os.remove(meta_file)
    with pytest.raises(UserError, match="jaxspec_drafter.json is missing"):
        load_drafter(d)


def test_target_fingerprint_is_the_same_in_float32_and_bfloat16():
    """A drafter trained on CPU (float32 target) is found for the same target on TPU/GPU (bfloat16), and a changed
    weight changes the fingerprint."""
    from conftest import fixture_path

    from jaxspec import load_model

    f32 = load_model(fixture_path("tiny-llama3"), dtype=jnp.float32)
    bf16 = load_model(fixture_path("tiny-llama3"), dtype=jnp.bfloat16)
    assert f32.fingerprint() == bf16.fingerprint()
    embed = f32.weights.embed.at[0, 0].add(1.0)
    changed = dataclasses.replace(f32, weights=dataclasses.replace(f32.weights, embed=embed))
    assert changed.fingerprint() != f32.fingerprint()
