"""Hugging Face folders: sharded safetensors with an index load like a single file; missing shards are refused."""

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
