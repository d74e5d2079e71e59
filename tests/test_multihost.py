"""Multiple hosts, simulated: two processes on this machine, each with 2 fake CPU devices, joined by
`jax.distributed` on 127.0.0.1 (CPU collectives over gloo). They train a Medusa drafter data-parallel over a mesh
of 4 devices and end with the parameters one process with 4 devices gets (each process reading the saved features
of its own rows only, the run's files written once), and they decode speculatively on a data=4 mesh to the tokens
one process gets.

The processes run this file with `--child` (their settings in the environment)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(data: str, out_dir: str) -> dict:
    from conftest import fixture_path

    return {"method": "medusa", "target": fixture_path("tiny-llama3"), "dtype": "float32",
            "data": {"path": data, "seq_len": 32, "eval_holdout": 4},
            "optim": {"learning_rate": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
            "loss": {"kind": "forward_kl", "position_decay": 0.8},
            "run": {"steps": 3, "batch_size": 4, "seed": 0, "out_dir": out_dir, "save_every": 1,
                    "keep_checkpoints": 2, "eval_every": 3, "eval_prompts": 2, "log_every": 1},
            "mesh": {"data": 4},
            "drafter": {"num_heads": 2, "choices": [[0], [1], [0, 0]], "positions_per_row": 8}}


def _run(config: dict | None, out: str, processes: int, tmp_path, mode: str | None = None) -> list[dict]:
    """Runs this file's child in `processes` processes over 4 devices in all: training with `config`, or (None) the
    generation of `_child_generate` (or the `mode` given: "load"). Returns each process's JSON."""
    path = tmp_path / f"{os.path.basename(out)}.json"
    path.write_text(json.dumps(config))
    from fake_devices import fake_device_env

    env = dict(fake_device_env(4 // processes),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), *filter(None, [os.environ.get(
                   "PYTHONPATH")])]))
    if processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES=str(processes),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    # output to files, not pipes: a child blocked on a full pipe would never reach the others' shutdown barrier
    logs = [(open(f"{out}.{i}.out", "w+"), open(f"{out}.{i}.err", "w+")) for i in range(processes)]
    mode = mode or ("train" if config else "generate")
    children = [subprocess.Popen([sys.executable, __file__, "--child", mode, str(path),
                                  out],
                                 env=dict(env, JAX_PROCESS_ID=str(i)), cwd=ROOT, stdout=logs[i][0], stderr=logs[i][1])
                for i in range(processes)]
    results = []
    for child, (stdout, stderr) in zip(children, logs):
        child.wait(timeout=600)
        stdout.seek(0)
        stderr.seek(0)
        out_text, err_text = stdout.read(), stderr.read()
        stdout.close()
        stderr.close()
        assert child.returncode == 0, f"child failed:\n{out_text[-3000:]}\n{err_text[-3000:]}"
        results.append(json.loads(out_text.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def data_with_features(tmp_path_factory):
    from conftest import fixture_path

    from jaxspec import load_model
    from jaxspec.data import regenerate_ids

    target = load_model(fixture_path("tiny-llama3"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=int(rng.integers(4, 12))).tolist() for _ in range(20)]
    out = str(tmp_path_factory.mktemp("regen"))
    regenerate_ids(target, prompts, out, max_prompt_tokens=16, max_new_tokens=20, batch_size=5, shard_size=10,
                   progress=False, feature_layers=(2,))  # the last layer: what Medusa trains on
    return out


def test_two_processes_train_like_one(data_with_features, tmp_path):
    one = _run(_config(data_with_features, str(tmp_path / "one")), str(tmp_path / "one"), 1, tmp_path)
    two = _run(_config(data_with_features, str(tmp_path / "two")), str(tmp_path / "two"), 2, tmp_path)
    assert [r["processes"] for r in one + two] == [1, 2, 2] and all(r["devices"] == 4 for r in one + two)
    for a, b, c in zip(one[0]["params"], two[0]["params"], two[1]["params"], strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))  # every process holds the same copy
    # each process read the saved features of 2 of the 4 rows of every batch (its 2 devices' rows); one read all
    assert one[0]["feature_rows_read"] == [4, 4, 4]
    assert two[0]["feature_rows_read"] == two[1]["feature_rows_read"] == [2, 2, 2]
    # the run's files written once: 3 loss records and one evaluation, a drafter
    records = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 4 and (tmp_path / "two" / "drafter" / "params.safetensors").exists()
    assert two[0]["eval_tau"] == one[0]["eval_tau"] and two[1]["eval_tau"] is None


def test_two_processes_train_with_the_target_split_like_one(data_with_features, tmp_path):
    """mesh data=2, model=2 over the two processes: each loads the frozen target straight onto its devices' shards
    (`load_model(..., mesh=)`, which builds the global arrays from each process's own slices), and the run ends with
    the parameters of one 4-device process; the held-out evaluation runs on the mesh too, every process taking part,
    and gives one process's tau."""
    config = dict(_config(data_with_features, ""), mesh={"data": 2, "model": 2})
    one = _run(dict(config, run=dict(config["run"], out_dir=str(tmp_path / "one-tp"))), str(tmp_path / "one-tp"), 1,
               tmp_path)
    two = _run(dict(config, run=dict(config["run"], out_dir=str(tmp_path / "two-tp"))), str(tmp_path / "two-tp"), 2,
               tmp_path)
    assert [r["processes"] for r in one + two] == [1, 2, 2]
    for a, b, c in zip(one[0]["params"], two[0]["params"], two[1]["params"], strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    assert one[0]["eval_tau"] is not None and two[0]["eval_tau"] == one[0]["eval_tau"]


def test_speculative_generation_across_two_processes_equals_one(tmp_path):
    """Autoregressive decoding, prompt lookup and EAGLE-3 (an untrained head) on a data=4 mesh spanning two
    processes give the tokens one 4-device process gives (which are autoregressive decoding's)."""
    one = _run(None, str(tmp_path / "gen-one"), 1, tmp_path)
    two = _run(None, str(tmp_path / "gen-two"), 2, tmp_path)
    assert one[0]["tokens"] == two[0]["tokens"] == two[1]["tokens"]
    assert one[0]["tokens"]["prompt-lookup"] == one[0]["tokens"]["eagle3"] == one[0]["tokens"]["autoregressive"]


def test_each_process_reads_only_the_slices_its_devices_hold(tmp_path):
    """A target loaded onto a (data 2, model 2) mesh whose model axis spans the two processes (each holds one model
    shard on both of its devices): each process reads about half the checkpoint (its heads, columns and vocabulary
    rows; the norms whole), and its arrays hold the values of a plain load at their slices."""
    one = _run(None, str(tmp_path / "load-one"), 1, tmp_path, mode="load")
    two = _run(None, str(tmp_path / "load-two"), 2, tmp_path, mode="load")
    assert one[0]["equal"] and two[0]["equal"] and two[1]["equal"]
    model_bytes = one[0]["model_bytes"]
    assert one[0]["read_bytes"] == model_bytes  # one process holds every slice: the checkpoint read once
    for r in two:
        assert 0.5 * model_bytes <= r["read_bytes"] <= 0.55 * model_bytes, r
    assert two[0]["read_bytes"] + two[1]["read_bytes"] > model_bytes  # the replicated norms read by both


def _child_load() -> None:
    """Loads tiny-llama3 onto a (data 2, model 2) mesh with the model axis across processes; prints the bytes read
    and whether every array this process holds equals a plain load at its slice."""
    import jax
    from checkpoint_reads import counting_checkpoint_reads
    from conftest import fixture_path

    from jaxspec import load_model
    from jaxspec.arguments import join_distributed
    from jaxspec.sharding import make_mesh

    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        join_distributed()
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    half = len(by_process) // 2  # rows (data) of the mesh: device i of every process, so each process holds one column
    devices = [by_process[i + column * half] for i in range(half) for column in range(2)]
    mesh = make_mesh(2, 2, devices=devices)
    plain = load_model(fixture_path("tiny-llama3"), with_tokenizer=False).weights
    with counting_checkpoint_reads() as count:
        on_mesh = load_model(fixture_path("tiny-llama3"), with_tokenizer=False, mesh=mesh).weights
    equal = all(np.array_equal(np.asarray(shard.data), np.asarray(whole)[shard.index])
                for x, whole in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(plain), strict=True)
                for shard in x.addressable_shards)
    print(json.dumps({"process": jax.process_index(), "equal": equal, "read_bytes": count["read"],
                      "model_bytes": sum(x.nbytes for x in jax.tree.leaves(plain))}))


def _child_generate() -> None:
    import jax
    from conftest import fixture_path

    from jaxspec import load_model
    from jaxspec.arguments import join_distributed
    from jaxspec.methods import MethodOptions, build_method

    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        join_distributed()
    target = load_model(fixture_path("tiny-llama3"))
    prompts = [[5, 9, 33, 2], list(range(40, 58)), [7, 8], [100, 101, 102, 103, 104]]
    tokens = {}
    for name in ("autoregressive", "prompt-lookup", "eagle3"):
        method = build_method(name, target, MethodOptions(mesh="data=4",
                                                          drafter="untrained" if name == "eagle3" else None))
        tokens[name] = method.generate(prompts, max_new_tokens=12, eos_ids=()).token_ids
    print(json.dumps({"process": jax.process_index(), "tokens": tokens}))


def _child(config_path: str, out: str) -> None:
    import jax

    from jaxspec.config_files import from_dict
    from jaxspec.data import RegeneratedDataset
    from jaxspec.training.config import TrainConfig
    from jaxspec.training.distill import maybe_initialize_distributed, train

    maybe_initialize_distributed()
    rows_read = []
    features = RegeneratedDataset.features

    def counting(self, indices, layers, seq_len):
        rows_read.append(len(indices))
        return features(self, indices, layers, seq_len)

    RegeneratedDataset.features = counting
    with open(config_path) as f:
        config = from_dict(TrainConfig, json.load(f))
    summary = train(config, progress=False)
    tau = None
    if jax.process_index() == 0:  # the only writer of the run's files
        with open(os.path.join(out, "metrics.jsonl")) as f:
            tau = next((json.loads(line)["eval_tau"] for line in f if "eval_tau" in line), None)
    params = [np.asarray(x.addressable_data(0)).tolist() for x in jax.tree.leaves(summary["params"])]
    print(json.dumps({"processes": jax.process_count(), "devices": len(jax.devices()),
                      "feature_rows_read": rows_read, "params": params, "eval_tau": tau}))

if __name__ == "__main__" and "--child" in sys.argv:
    import jax

    jax.config.update("jax_disable_most_optimizations", True)  # a tiny model: compiling is the time, not running
    mode, *rest = sys.argv[sys.argv.index("--child") + 1:]
    if mode == "train":
        _child(*rest)
    elif mode == "load":
        _child_load()
    else:
        _child_generate()
