"""Medusa heads in the Medusa repository's layout (the one its training scripts write and TGI and TensorRT-LLM read).

A folder with `config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) and
`medusa_lm_head.safetensors`. The names follow FasterDecoding/Medusa `medusa/model/medusa_model.py`: `MedusaModel`
builds `medusa_head` as K `nn.Sequential(ResBlock * medusa_num_layers, nn.Linear(d, V, bias=False))`, `ResBlock`
computes x + SiLU(linear(x)) with a bias, and the heads read the base model's final-normed last hidden state; the
training scripts save `medusa_head.state_dict()` with safetensors' `save_file` (older releases ship a torch pickle,
`medusa_lm_head.pt`, which is refused with the command that converts it).

Tensors (torch `nn.Linear` weights are [out, in]; ours are [in, out]), head k of K:

    {k}.0.linear.weight   [d, d]   w[k].T
    {k}.0.linear.bias     [d]      b[k]
    {k}.1.weight          [V, d]   lm_head[k].T (the target's LM head when jaxspec's heads share it)

jaxspec's Medusa head is that layout with one residual block (`medusa_num_layers: 1`, what Medusa trains by
default); other depths are refused. A head is imported with its own LM heads unless every one equals the target's,
in which case it shares the target's (the same logits, K fewer [d, V] copies).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.drafters.medusa import DEFAULT_CHOICES, MedusaConfig, MedusaParams
from jaxspec.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _shared_lm_head(target_weights) -> jax.Array:
    return target_weights.embed.T if target_weights.lm_head is None else target_weights.lm_head  # [d, V]


def export_medusa_hf(path: str | os.PathLike, params: MedusaParams, target_weights, dtype: str = "bfloat16",
                     base_model: str = "") -> str:
    """Writes Medusa heads as `config.json` + `medusa_lm_head.safetensors` in the Medusa repository's layout.

    Args:
        path: the output folder (created).
        params: the heads; with a shared LM head, the target's is written into every head (the layout has no
            shared head). target_weights: the target's weights (for that LM head).
        dtype: "bfloat16", "float16" or "float32" (exact).
        base_model: `base_model_name_or_path` to record (the target's source).
    Returns:
        The folder.
    """
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise UserError(f"Export dtype '{dtype}' is not supported; use one of {', '.join(EXPORT_DTYPES)}.")
    w = np.asarray(jax.device_get(params.w), np.float32)  # [K, d, d]
    b = np.asarray(jax.device_get(params.b), np.float32)  # [K, d]
    shared = None if params.lm_head is not None else np.asarray(jax.device_get(_shared_lm_head(target_weights)),
                                                                 np.float32)  # [d, V]
    tensors = {}
    for k in range(w.shape[0]):
        lm = shared if shared is not None else np.asarray(jax.device_get(params.lm_head[k]), np.float32)  # [d, V]
        tensors[f"{k}.0.linear.weight"] = np.ascontiguousarray(w[k].T)
        tensors[f"{k}.0.linear.bias"] = b[k]
        tensors[f"{k}.1.weight"] = np.ascontiguousarray(lm.T)
    tensors = {name: x.astype(EXPORT_DTYPES[dtype]) for name, x in tensors.items()}
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    save_file(tensors, weights_path + ".tmp", metadata={"format": "pt"})
    os.replace(weights_path + ".tmp", weights_path)
    config = {"medusa_num_heads": int(w.shape[0]), "medusa_num_layers": 1, "base_model_name_or_path": base_model,
              "hidden_size": int(w.shape[1]), "vocab_size": int(tensors["0.1.weight"].shape[0]), "torch_dtype": dtype}
    with open(os.path.join(path, CONFIG_FILE) + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(os.path.join(path, CONFIG_FILE) + ".tmp", os.path.join(path, CONFIG_FILE))
    return path


def is_medusa_folder(path: str) -> bool:
    """Whether `path` holds Medusa heads in the Medusa repository's layout."""
    return os.path.isfile(os.path.join(path, WEIGHTS_FILE)) or os.path.isfile(os.path.join(path, "medusa_lm_head.pt"))


def _read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    where = f"Medusa heads {path}"
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise UserError(f"{where}: no {CONFIG_FILE} (medusa_num_heads, medusa_num_layers); the folder is incomplete.")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{config_path} cannot be read ({e}).") from None
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise UserError(f"{where} has no {WEIGHTS_FILE}: jaxspec reads only safetensors. Convert medusa_lm_head.pt "
                        "once with torch: python -c \"import torch; from safetensors.torch import save_file; "
                        "save_file({k: v.contiguous() for k, v in torch.load('medusa_lm_head.pt', "
                        "map_location='cpu').items()}, 'medusa_lm_head.safetensors')\" (in that folder).")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{weights_path} cannot be read as safetensors ({e}).") from None
    return config, tensors


def import_medusa_hf(path: str | os.PathLike, target_cfg: ModelConfig, target_weights=None
                     ) -> tuple[MedusaParams, MedusaConfig]:
    """Reads Medusa heads in the Medusa repository's layout into float32 params for this target.

    Args:
        path: the folder (config.json + medusa_lm_head.safetensors).
        target_cfg: the target's config; target_weights: its weights, to share the target's LM head when every
            head's equals it (None: each head keeps its own).
    Returns:
        (MedusaParams float32, MedusaConfig with the head count and the default tree cut to that many heads).
    Raises:
        UserError: what is wrong and what to do (another depth of residual blocks, another target's widths or
            vocabulary, missing or extra tensors).
    """
    path = os.fspath(path)
    where = f"Medusa heads {path}"
    config, tensors = _read(path)
    d, v = target_cfg.hidden_size, target_cfg.vocab_size
    try:
        k_heads = int(config["medusa_num_heads"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: config.json has no medusa_num_heads; is this a Medusa head folder?") from None
    layers = int(config.get("medusa_num_layers", 1))
    if layers != 1:
        raise UserError(f"{where} has {layers} residual blocks per head (medusa_num_layers); jaxspec's Medusa heads "
                        "have one, Medusa's default.")
    wanted = {f"{k}.{name}" for k in range(k_heads) for name in ("0.linear.weight", "0.linear.bias", "1.weight")}
    missing, extra = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or extra:
        problems = ([f"missing {', '.join(missing[:4])}"] if missing else []) + \
                   ([f"unexpected {', '.join(extra[:4])}"] if extra else [])
        raise UserError(f"{where} does not hold {k_heads} heads of one residual block each ({'; '.join(problems)}).")
    if tensors["0.1.weight"].shape[0] != v:
        raise UserError(f"{where} predicts over {tensors['0.1.weight'].shape[0]} tokens but the target has {v}; it was "
                        f"trained for another target (another tokenizer). Use the Medusa heads made for this model.")
    shapes = {"0.linear.weight": (d, d), "0.linear.bias": (d,), "1.weight": (v, d)}
    wrong = [f"{k}.{n} {tuple(tensors[f'{k}.{n}'].shape)} (expected {s})" for k in range(k_heads)
             for n, s in shapes.items() if tuple(tensors[f"{k}.{n}"].shape) != s]
    if wrong:
        raise UserError(f"{where} does not fit this target (width {d}): {'; '.join(wrong[:3])}; it was trained for "
                        "another target.")

    def f32(name):
        return np.asarray(tensors[name], np.float32)

    w = np.stack([f32(f"{k}.0.linear.weight").T for k in range(k_heads)])  # [K, d, d]
    b = np.stack([f32(f"{k}.0.linear.bias") for k in range(k_heads)])  # [K, d]
    lm = np.stack([f32(f"{k}.1.weight").T for k in range(k_heads)])  # [K, d, V]
    own = True
    if target_weights is not None:
        shared = np.asarray(jax.device_get(_shared_lm_head(target_weights)), np.float32)  # [d, V]
        own = not all(np.array_equal(lm[k], shared.astype(tensors["0.1.weight"].dtype).astype(np.float32))
                      for k in range(k_heads))
    params = MedusaParams(w=jnp.asarray(w), b=jnp.asarray(b), lm_head=jnp.asarray(lm) if own else None)
    choices = tuple(c for c in DEFAULT_CHOICES if len(c) <= k_heads)
    return params, MedusaConfig(num_heads=k_heads, own_lm_head=own, choices=choices)


__all__ = ["export_medusa_hf", "import_medusa_hf", "is_medusa_folder"]
