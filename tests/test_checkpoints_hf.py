"""Hugging Face folders: sharded safetensors with an index load like a single file; missing shards are refused."""

import glob
import json
import shutil

import numpy as np
import pytest
from conftest import fixture_path
from safetensors.numpy import load_file, save_file

from jaxspec import load_model
from jaxspec.errors import UserError


def _shard(tmp_path):
    src = fixture_path("tiny-qwen2")
    tensors = load_file(f"{src}/model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    return tmp_path


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    whole = load_model(fixture_path("tiny-qwen2"))
    sharded = load_model(str(_shard(tmp_path)))
    assert sharded.config == whole.config
    import jax

    for a, b in zip(jax.tree.leaves(whole.weights), jax.tree.leaves(sharded.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_shard_is_refused(tmp_path):
    folder = _shard(tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="missing"):
        load_model(str(folder))


def test_truncated_safetensors_is_refused(tmp_path):
    shutil.copy(fixture_path("tiny-qwen2/config.json"), tmp_path / "config.json")
    data = open(fixture_path("tiny-qwen2/model.safetensors"), "rb").read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_model(str(tmp_path))


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    """A Qwen3-MoE folder saved with the fused expert tensors transformers 5 holds in memory
    (mlp.experts.gate_up_proj [E, 2F, d], mlp.experts.down_proj [E, d, F]) loads the same weights as the per-expert
    folder it was made from."""
    import re

    src = fixture_path("tiny-qwen3moe")
    tensors = {}
    for file in sorted(glob.glob(f"{src}/*.safetensors")):
        tensors.update(load_file(file))
    fused, experts = {}, {}
    for name, value in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
        else:
            fused[name] = value
    for (prefix, kind), by_index in experts.items():
        experts[(prefix, kind)] = np.stack([by_index[e] for e in sorted(by_index)])
    for prefix in {p for p, _ in experts}:
        fused[f"{prefix}.gate_up_proj"] = np.concatenate([experts[(prefix, "gate_proj")],
                                                          experts[(prefix, "up_proj")]], axis=1)  # [E, 2F, d]
        fused[f"{prefix}.down_proj"] = experts[(prefix, "down_proj")]  # [E, d, F]
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    import jax

    whole, from_fused = load_model(src, with_tokenizer=False), load_model(str(tmp_path), with_tokenizer=False)
    assert whole.weights.layers.expert_gate is not None
    for a, b in zip(jax.tree.leaves(whole.weights), jax.tree.leaves(from_fused.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
