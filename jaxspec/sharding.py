"""Sharding, declared once: mesh axis names, logical axis names, and the logical axes of every array.

A 2-D mesh (data, model): the batch splits over `data`; attention heads, key/value heads, the feed-forward
width and the vocabulary split over `model` (Megatron-style tensor parallelism); everything else (model width,
layer axis, head dim, cache slots) is replicated. Arrays name their axes logically (`WEIGHT_AXES`,
`LAYER_WEIGHT_AXES`, `CACHE_AXES`) and `LOGICAL_AXIS_RULES` maps those names onto the mesh, so changing
the parallelism plan means editing one table. `jax.jit` with these shardings lets XLA's partitioner insert
the collectives (an all-reduce after `wo` and `w_down`, a gather of the vocabulary-sharded logits).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.model import LayerWeights, Weights

# Mesh axis names.
DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

# Logical axis name -> mesh axis (None: replicated).
LOGICAL_AXIS_RULES: Mapping[str, str | None] = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "embed": None,
    "layers": None,
    "head_dim": None,
    "seq": None,
}

# Logical axes of each `LayerWeights` field (every one carries the leading layer axis).
LAYER_WEIGHT_AXES: Mapping[str, tuple[str, ...]] = {
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
}

# Logical axes of the top-level `Weights` fields other than `layers`.
WEIGHT_AXES: Mapping[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}

# Logical axes of each `KVCache` field.
CACHE_AXES: Mapping[str, tuple[str, ...]] = {
    "k": ("layers", "batch", "kv_heads", "seq", "head_dim"),
    "v": ("layers", "batch", "kv_heads", "seq", "head_dim"),
    "lengths": ("batch",),
}


# ---------------------------------------------------------------------------------------------- meshes


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the (data, model) mesh over all the given devices.

    Args:
        data: size of the data-parallel axis (splits the batch).
        model: size of the tensor-parallel axis (splits heads, feed-forward width and vocabulary).
        devices: the devices to use; default `jax.devices()`. All of them must be used.

    Returns:
        A `Mesh` with axes (DATA, MODEL) of sizes (data, model).

    Raises:
        UserError: if a size is not positive or data * model is not the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise UserError(f"Mesh axis sizes must be at least 1, got data={data} and model={model}.")
    if data * model != len(devices):
        raise UserError(
            f"A mesh of data={data} x model={model} needs {data * model} devices, but {len(devices)} are "
            f"available; choose sizes whose product is {len(devices)}."
        )
    # jax.make_mesh orders devices to follow the physical topology (rings on TPU); Auto axes let jit's
    # partitioner place the collectives.
    return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def logical_spec(axes: Sequence[str]) -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions have the given logical names."""
    try:
        return PartitionSpec(*(LOGICAL_AXIS_RULES[a] for a in axes))
    except KeyError as e:
        raise ValueError(f"Unknown logical axis {e.args[0]!r}; known: {', '.join(LOGICAL_AXIS_RULES)}.") from None


def logical_sharding(mesh: Mesh, axes: Sequence[str]) -> NamedSharding:
    """The NamedSharding on `mesh` of an array whose dimensions have the given logical names."""
    return NamedSharding(mesh, logical_spec(axes))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a batch-major array (tokens [B, T], lengths [B], ...): rows over `data`, the rest replicated."""
    return logical_sharding(mesh, ("batch",) + ("seq",) * (ndim - 1))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts a full copy on every device (scalars, PRNG keys)."""
    return NamedSharding(mesh, PartitionSpec())


# ---------------------------------------------------------------------------------------------- pytrees


def _field_sharding(mesh: Mesh, owner: str, name: str, value, axes: Mapping[str, tuple[str, ...]]):
    """NamedSharding for one dataclass field from its logical axes; None stays None. Checks the rank."""
    if value is None:
        return None
    names = axes[name]
    if len(value.shape) != len(names):
        raise ValueError(f"{owner}.{name} has shape {tuple(value.shape)}, but its logical axes are {names}.")
    return logical_sharding(mesh, names)


def weight_shardings(weights: Weights, mesh: Mesh) -> Weights:
    """A `Weights` pytree of NamedShardings mirroring `weights` (fields that are None stay None).

    `weights` may hold arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`); only ranks are read.
    The result can be passed as `in_shardings` to `jax.jit` or to `jax.device_put`.
    """
    layers = LayerWeights(
        **{
            f.name: _field_sharding(mesh, "LayerWeights", f.name, getattr(weights.layers, f.name), LAYER_WEIGHT_AXES)
            for f in dataclasses.fields(LayerWeights)
        }
    )
    top = {name: _field_sharding(mesh, "Weights", name, getattr(weights, name), WEIGHT_AXES) for name in WEIGHT_AXES}
    return Weights(layers=layers, **top)


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """A `KVCache` pytree of NamedShardings: k, v [L, B, Hkv, S, D] by (-, data, model, -, -); lengths by data."""
    return KVCache(
        **{name: _field_sharding(mesh, "KVCache", name, getattr(cache, name), CACHE_AXES) for name in CACHE_AXES}
    )


def shard_weights(weights: Weights, mesh: Mesh) -> Weights:
    """Places `weights` on the mesh (each device receives only its shards)."""
    return jax.device_put(weights, weight_shardings(weights, mesh))


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """Places `cache` on the mesh."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


# ---------------------------------------------------------------------------------------------- checks


def check_divisible(cfg: ModelConfig, batch_size: int, mesh: Mesh | jax.sharding.AbstractMesh) -> None:
    """Checks that the mesh splits the model and the batch evenly, before any work is done.

    Args:
        cfg: the model's config.
        batch_size: rows in a batch (B).
        mesh: a (data, model) mesh, concrete or abstract.

    Raises:
        UserError: naming every size the model axis does not divide (num_heads, num_kv_heads,
            intermediate_size, vocab_size) or a batch the data axis does not divide, and what to do.
    """
    sizes = dict(mesh.shape)
    model, data = sizes.get(MODEL, 1), sizes.get(DATA, 1)
    problems = []
    model_dims = {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    bad = [f"{name}={value}" for name, value in model_dims.items() if value % model]
    if bad:
        common = math.gcd(*model_dims.values())
        choices = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
        problems.append(
            f"the mesh's model axis of size {model} does not divide {', '.join(bad)}; use a model axis size "
            f"that divides all of num_heads, num_kv_heads, intermediate_size and vocab_size ({choices})"
        )
    if batch_size % data:
        problems.append(
            f"the batch of {batch_size} rows does not split over the mesh's data axis of size {data}; use a "
            f"batch that is a multiple of {data} (pad it with dummy rows) or a data axis size that divides {batch_size}"
        )
    if problems:
        message = "; and ".join(problems)
        raise UserError(message[0].upper() + message[1:] + ".")
