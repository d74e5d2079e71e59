"""EAGLE-3 drafters in the Hugging Face format of the public EAGLE-3 checkpoints (the one vLLM and SGLang load).

A folder with `config.json` and safetensors weights (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`). Only safetensors is read: convert a `pytorch_model.bin` first (see
`import_eagle3_hf`). The format follows, and the names below were taken from:
- SafeAILab/EAGLE `eagle/traineagle3/cnets.py` (the EAGLE-3 training code: `Model`, `LlamaDecoderLayeremb`, the
  vocabulary map in `scandata`) and `eagle/model/modeling_llama_kv.py` (which target layers are fused);
- sgl-project/SpecForge `specforge/modeling/draft/llama3_eagle.py` (`LlamaForCausalLMEagle3`) and
  `specforge/data/preprocessing.py` (`process_token_dict_to_mappings`);
- vllm-project/vllm `vllm/model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM.load_weights`,
  `compute_logits`) and `vllm/v1/worker/gpu_model_runner.py` (`_get_eagle3_aux_layers_from_config`);
- sgl-project/sglang `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`) and
  `python/sglang/srt/models/llama.py` (`set_eagle3_layers_to_capture`).
docs/eagle3-hf-format.md has the whole table and where the references disagree.

Tensors (torch `nn.Linear` weights are [out, in]; ours are [in, out]):

    fc.weight                                   [d, n d]       fc.T (features concatenated low, mid, high)
    midlayer.input_layernorm.weight             [d]            input_norm (applied to the token embedding)
    midlayer.hidden_norm.weight                 [d]            hidden_norm (applied to the fused feature)
    midlayer.self_attn.q_proj.weight            [Hq h, 2d]     wq.reshape(2d, Hq h).T
    midlayer.self_attn.k_proj.weight            [Hkv h, 2d]    wk.reshape(2d, Hkv h).T
    midlayer.self_attn.v_proj.weight            [Hkv h, 2d]    wv.reshape(2d, Hkv h).T
    midlayer.self_attn.o_proj.weight            [d, Hq h]      wo.reshape(Hq h, d).T
    midlayer.post_attention_layernorm.weight    [d]            mlp_norm
    midlayer.mlp.gate_proj.weight               [f, d]         w_gate.T
    midlayer.mlp.up_proj.weight                 [f, d]         w_up.T
    midlayer.mlp.down_proj.weight               [d, f]         w_down.T
    norm.weight                                 [d]            final_norm
    lm_head.weight                              [Vd, d]        lm_head.T
    d2t                                         int64[Vd]      OFFSETS: target id = draft id + d2t[draft id]
    t2d                                         bool[V]        True at the target ids the draft vocabulary holds
    embed_tokens.weight (optional)              [V, d]         not ours: the target's embedding is used
    fc_norm.{0,1,2}.weight (SpecForge, optional) [d]           fc_norm[i]: an RMSNorm on fused layer i before fc

The q/k/v input is concat(input_layernorm(embedding), hidden_norm(feature)), embedding first: our `_project`.

The reference draft vocabulary is ordered by target id (EAGLE and SpecForge sort the most frequent tokens by id, so
every offset is >= 0, and their training code selects the target's logits with `t2d` as a mask, which is only
right in that order). Ours is ordered by frequency. A permutation of the draft ids changes nothing the head
computes (the draft logits are scattered to target ids; only exact ties in top-k could break differently), so
`export_eagle3_hf` writes the reference order (`sort_draft_vocab`) and `import_eagle3_hf` keeps the file's order.

Feature layers. Ours count from 0 and name the layer whose OUTPUT (residual stream after it) is fused. The
references number them differently:
- no ids in config.json: every reference fuses the residual stream BEFORE layers (2, L // 2, L - 3), i.e. the
  outputs of our layers (1, L // 2 - 1, L - 4);
- vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` and id k means "before layer k" (our layer k - 1);
- SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 (id k is our layer k).
Export writes both keys, each in its reader's numbering, plus our own numbers under the "jaxspec" key; import
prefers "jaxspec", then vLLM's key, then SGLang's, then the default. The LAST layer's output is only reachable in
recent vLLM (older vLLM and SGLang capture before a layer), so export warns about it.

Which files are EAGLE-3 heads: the tensors decide (fc.weight and midlayer.*), not config.json's architectures
(EAGLE's own releases say LlamaForCausalLM, SpecForge and SGLang LlamaForCausalLMEagle3).

The head's RoPE and RMSNorm epsilon are its own, read from its config.json as vLLM, SGLang and current SpecForge
build the draft layer (`head_rope_and_eps`: rope_theta default 10000, where EAGLE trains its Llama-3.1 heads), and
kept in `Eagle3Config.rope_theta / rope_scaling / rms_norm_eps`; export writes them back (a jaxspec-trained head:
the target's). SpecForge's `fc_norm` heads (EAGLE-3.1) are run with their per-layer norms; `norm_output: false`
is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.config import ModelConfig, RopeScaling, _rope_scaling_from_hf
from jaxspec.drafters.eagle import Eagle3Config, Eagle3Params
from jaxspec.errors import UserError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # EAGLE/SpecForge/SGLang name, vLLM's own
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
JAXSPEC_KEY = "jaxspec"  # our extra section in config.json (tree settings, exact feature layers, target)
JAXSPEC_FORMAT = "jaxspec-eagle3-hf"
JAXSPEC_FORMAT_VERSION = 1
EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}

# Eagle3Params field -> (file name, "T": transposed / "qkv", "o": the attention reshapes / "": as is)
_WEIGHTS = {
    "fc": ("fc.weight", "T"),
    "input_norm": ("midlayer.input_layernorm.weight", ""),
    "hidden_norm": ("midlayer.hidden_norm.weight", ""),
    "wq": ("midlayer.self_attn.q_proj.weight", "qkv"),
    "wk": ("midlayer.self_attn.k_proj.weight", "qkv"),
    "wv": ("midlayer.self_attn.v_proj.weight", "qkv"),
    "wo": ("midlayer.self_attn.o_proj.weight", "o"),
    "mlp_norm": ("midlayer.post_attention_layernorm.weight", ""),
    "w_gate": ("midlayer.mlp.gate_proj.weight", "T"),
    "w_up": ("midlayer.mlp.up_proj.weight", "T"),
    "w_down": ("midlayer.mlp.down_proj.weight", "T"),
    "final_norm": ("norm.weight", ""),
    "lm_head": ("lm_head.weight", "T"),
}
OPTIONAL_TENSORS = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")


# ---------------------------------------------------------------------------------------------- layer numbering


def default_reference_layers(num_layers: int) -> tuple[int, ...]:
    """Our feature layers (outputs) that the references fuse when config.json names none: the residual stream
    before layers (2, L // 2, L - 3), i.e. after layers (1, L // 2 - 1, L - 4)."""
    return tuple(sorted(i - 1 for i in (2, num_layers // 2, num_layers - 3)))


def to_vllm_ids(feature_layers) -> list[int]:
    """Our layers (outputs) -> vLLM's `eagle_aux_hidden_state_layer_ids` (id k = before layer k = after k - 1)."""
    return [int(i) + 1 for i in sorted(feature_layers)]


def to_sglang_ids(feature_layers) -> list[int]:
    """Our layers -> SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang adds 1: same as ours)."""
    return [int(i) for i in sorted(feature_layers)]


# ---------------------------------------------------------------------------------------------- conversion


def sort_draft_vocab(params: Eagle3Params) -> Eagle3Params:
    """The same head with its draft ids ordered by target id (the references' order): lm_head's columns and d2t
    permuted together. Draft logits mapped to target ids are unchanged."""
    order = jnp.argsort(params.d2t, stable=True)  # [Vd]
    return dataclasses.replace(params, lm_head=params.lm_head[:, order], d2t=params.d2t[order])


def params_to_hf(params: Eagle3Params, vocab_size: int) -> dict[str, np.ndarray]:
    """Eagle3Params (any draft order) -> the reference tensors in float32 (d2t int64 offsets, t2d bool[V]), in
    the params' own draft order; `export_eagle3_hf` sorts first."""
    out = {}
    for field, (name, kind) in _WEIGHTS.items():
        x = np.asarray(jax.device_get(getattr(params, field)), np.float32)
        if kind == "qkv":  # [2d, H, h] -> [H h, 2d]
            x = x.reshape(x.shape[0], -1).T
        elif kind == "o":  # [Hq, h, d] -> [d, Hq h]
            x = x.reshape(-1, x.shape[-1]).T
        elif kind == "T":
            x = x.T
        out[name] = np.ascontiguousarray(x)
    targets = np.rint(np.asarray(jax.device_get(params.d2t), np.float64)).astype(np.int64)  # [Vd]
    out["d2t"] = targets - np.arange(targets.shape[0], dtype=np.int64)
    t2d = np.zeros(vocab_size, np.bool_)
    t2d[targets] = True
    out["t2d"] = t2d
    if params.fc_norm is not None:  # SpecForge's per-layer norms, one tensor per fused layer
        for i, w in enumerate(np.asarray(jax.device_get(params.fc_norm), np.float32)):
            out[f"fc_norm.{i}.weight"] = np.ascontiguousarray(w)
    return out


def hf_to_params(tensors: dict[str, np.ndarray], target_ids: np.ndarray, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> Eagle3Params:
    """Reference tensors (shapes already checked, lm_head.weight present) + absolute target ids -> float32 params."""
    fields = {}
    for field, (name, kind) in _WEIGHTS.items():
        x = np.asarray(tensors[name], np.float32)
        if kind == "qkv":  # [H h, 2d] -> [2d, H, h]
            x = x.T.reshape(x.shape[1], num_heads if field == "wq" else num_kv_heads, head_dim)
        elif kind == "o":  # [d, Hq h] -> [Hq, h, d]
            x = x.T.reshape(num_heads, head_dim, x.shape[0])
        elif kind == "T":
            x = x.T
        fields[field] = jnp.asarray(x, jnp.float32)
    n = fields["fc"].shape[0] // fields["fc"].shape[1]
    fc_norm = None
    if "fc_norm.0.weight" in tensors:  # [n, d]
        fc_norm = jnp.asarray(np.stack([np.asarray(tensors[f"fc_norm.{i}.weight"], np.float32) for i in range(n)]))
    return Eagle3Params(**fields, d2t=jnp.asarray(target_ids, jnp.float32), fc_norm=fc_norm)


def rope_scaling_for_export(scaling: RopeScaling) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for a head's RoPE, in the form most consumers read: null without scaling;
    linear as EAGLE's own loader demands it (exactly `type` and `factor`, which vLLM, SGLang and transformers read
    too); llama3 in transformers' five fields (vLLM, SGLang, SpecForge; EAGLE's loader knows only linear and
    dynamic, so it cannot load a head with llama3 scaling whatever the file says)."""
    if scaling.kind == "default":
        return None
    if scaling.kind == "linear":
        return {"type": "linear", "factor": float(scaling.factor)}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def head_rope_and_eps(config: dict[str, Any], where: str) -> tuple[float, RopeScaling, float]:
    """(rope_theta, rope scaling, rms_norm_eps) a head was trained with, from its config.json, as vLLM, SGLang and
    current SpecForge build the draft layer: `rope_theta` (or transformers 5's `rope_parameters.rope_theta`),
    default 10000 (EAGLE's released Llama-3.1 configs have none, and EAGLE trains at base 10000);
    `rope_scaling` or `rope_parameters` (keys `rope_type` or the older `type`); `rms_norm_eps`, default 1e-6
    (transformers' LlamaConfig)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else params
    theta = config.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    try:
        rope = _rope_scaling_from_hf(scaling or {})
    except (UserError, KeyError, TypeError, ValueError):
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        raise UserError(f"{where} was trained with RoPE scaling {kind!r} ({scaling}); jaxspec's head runs default, "
                        "linear and llama3 RoPE only, and running it with another would change what it drafts.") \
            from None
    return float(theta), rope, float(config.get("rms_norm_eps", 1e-6))


# ---------------------------------------------------------------------------------------------- export


def export_eagle3_hf(path: str | os.PathLike, params: Eagle3Params, mcfg: Eagle3Config, target_cfg: ModelConfig,
                     dtype: str = "bfloat16", *, target_fingerprint: str | None = None,
                     target_source: str | None = None) -> str:
    """Writes an EAGLE-3 head as `config.json` + `model.safetensors` in the public checkpoints' format.

    The draft vocabulary is written in the references' order (by target id); weights in `dtype`, d2t as int64
    offsets and t2d as bool, exactly as EAGLE and SpecForge save them. config.json also carries the head's RoPE
    and epsilon (its own: the target's unless it was imported with others; `rope_scaling` in the form most readers
    take, see `rope_scaling_for_export`), the feature layers in vLLM's and SGLang's numbering, and a
    "jaxspec" section (format version, our feature layers, the drafter config with the tree settings, the target's
    fingerprint and source when given) that `import_eagle3_hf` uses and other readers ignore.

    Args:
        path: the output folder (created; must not hold other safetensors files).
        params: the head; mcfg: its config (feature layers null: the default); target_cfg: the target's config.
        dtype: "bfloat16" (the public checkpoints'), "float16" or "float32" (exact).
        target_fingerprint, target_source: `LoadedModel.fingerprint()` and `.source` of the target, if known.
    Returns:
        The folder.
    Raises:
        UserError: a head the format cannot express (not 3 feature layers, shapes that do not fit the target, a
            broken vocabulary map) or an unknown dtype.
    """
    from safetensors.numpy import save_file

    from jaxspec.config_files import to_dict

    if dtype not in EXPORT_DTYPES:
        raise UserError(f"Export dtype '{dtype}' is not supported; use one of {', '.join(EXPORT_DTYPES)}.")
    cfg = mcfg.for_target(target_cfg)
    layers = [int(i) for i in cfg.feature_layers]
    d, v, big = target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_layers
    if len(layers) != 3 or len(set(layers)) != 3:
        raise UserError(f"The EAGLE-3 Hugging Face format fuses exactly 3 distinct target layers (vLLM and SGLang "
                        f"build fc for 3 x hidden_size); this head fuses {layers}. Only EAGLE-3 heads with three "
                        "feature layers can be exported.")
    if big - 1 in layers:
        warnings.warn(f"This head fuses the output of the target's last layer ({big - 1}); only recent vLLM "
                      f"versions can feed it (SGLang and older vLLM capture the stream before a layer, so they can "
                      f"reach layers 0..{big - 2} only).", UserWarning, stacklevel=2)
    if params.fc_norm is not None:
        warnings.warn("This head normalises each fused layer before fc (SpecForge's fc_norm): SpecForge runs it as "
                      "trained, but SGLang's EAGLE-3 loader skips the fc_norm tensors it does not know, and would "
                      "run it without them.", UserWarning, stacklevel=2)
    expected = {"fc": (3 * d, d), "wq": (2 * d, target_cfg.num_heads, target_cfg.head_dim),
                "wk": (2 * d, target_cfg.num_kv_heads, target_cfg.head_dim), "final_norm": (d,)}
    for field, shape in expected.items():
        if tuple(getattr(params, field).shape) != shape:
            raise UserError(f"The head's {field} has shape {tuple(getattr(params, field).shape)}, but this target "
                            f"needs {shape}; was the head trained for another target?")
    targets = np.rint(np.asarray(jax.device_get(params.d2t), np.float64)).astype(np.int64)
    if targets.min() < 0 or targets.max() >= v or len(np.unique(targets)) != len(targets):
        raise UserError(f"The head's draft-to-target map is broken (ids outside [0, {v}) or repeated); it cannot be "
                        "exported.")

    order = np.argsort(layers, kind="stable")  # fc's input blocks in ascending layer order, as the references cat
    fc = np.asarray(jax.device_get(params.fc)).reshape(3, d, d)[order].reshape(3 * d, d)
    fc_norm = None if params.fc_norm is None else jnp.asarray(np.asarray(jax.device_get(params.fc_norm))[order])
    head = sort_draft_vocab(dataclasses.replace(params, fc=jnp.asarray(fc), fc_norm=fc_norm))
    tensors = params_to_hf(head, v)
    np_dtype = EXPORT_DTYPES[dtype]
    tensors = {k: (x if x.dtype.kind in "bi" else x.astype(np_dtype)) for k, x in tensors.items()}

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    stale = [f for f in os.listdir(path) if (f.endswith(".safetensors") and f != WEIGHTS_FILE) or f == INDEX_FILE]
    if stale:
        raise UserError(f"{path} already holds other weights ({', '.join(sorted(stale))}); export into an empty "
                        "folder so readers do not mix them with this head.")
    layers = sorted(layers)
    vd = int(targets.shape[0])
    config = {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": int(params.w_gate.shape[1]),
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,  # the head's own (the target's unless it was imported with others)
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_for_export(cfg.rope_scaling),
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,
        **({"fc_norm": True} if params.fc_norm is not None else {}),
        "bos_token_id": target_cfg.bos_token_id,
        "eos_token_id": list(target_cfg.eos_token_ids) or None,
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": to_vllm_ids(layers),  # vLLM: id k = the stream before layer k
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_sglang_ids(layers),  # SGLang adds 1 itself
                         "use_aux_hidden_state": True},
        JAXSPEC_KEY: {
            "format": JAXSPEC_FORMAT,
            "format_version": JAXSPEC_FORMAT_VERSION,
            "feature_layers": layers,  # ours: the target layers whose OUTPUT is fused, counted from 0
            "drafter": to_dict(cfg),
            "target": {"fingerprint": target_fingerprint, "source": target_source},
        },
    }
    weights_path = os.path.join(path, WEIGHTS_FILE)
    save_file(tensors, weights_path + ".tmp", metadata={"format": "pt"})
    os.replace(weights_path + ".tmp", weights_path)
    config_path = os.path.join(path, CONFIG_FILE)
    with open(config_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(config_path + ".tmp", config_path)
    return path


# ---------------------------------------------------------------------------------------------- import


def read_hf_folder(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json as a dict, every tensor by name) of a folder: one or several *.safetensors, or the shards
    listed in model.safetensors.index.json. A leading "model." is dropped from names (SGLang accepts both)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not os.path.isdir(path):
        raise UserError(f"{path} is not a folder; pass the folder holding the drafter's config.json and "
                        "*.safetensors.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise UserError(f"{path} has no {CONFIG_FILE}; an EAGLE-3 drafter folder needs config.json and its weights.")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{config_path} cannot be read ({e}).") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} is not a JSON object.")
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index_path} cannot be read ({e}).") from None
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        bins = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
        hint = (f" It has {', '.join(bins)}: jaxspec reads only safetensors. Convert it once with torch: "
                "python -c \"import torch; from safetensors.torch import save_file; "
                f"save_file(torch.load('{bins[0]}', map_location='cpu'), 'model.safetensors')\" (in that folder)."
                if bins else "")
        raise UserError(f"{path} has no *.safetensors weights.{hint}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise UserError(f"{path} is incomplete: {name} (listed in {INDEX_FILE}) is missing.")
        try:
            part = load_file(file)
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise UserError(f"{file} cannot be read as safetensors ({e}).") from None
        for key, value in part.items():
            key = key[len("model."):] if key.startswith("model.") else key
            key = "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key  # vLLM's own name
            if key in tensors:
                raise UserError(f"{path} holds tensor {key} twice (in several files); keep one copy.")
            tensors[key] = value
    return config, tensors


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _feature_layers(config: dict[str, Any], section: dict[str, Any] | None, n: int, num_layers: int,
                    where: str) -> tuple[int, ...]:
    """Our feature layers from config.json (see the module docstring for the numbering); checked against n and L."""
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    sglang_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if section and section.get("feature_layers"):
        layers, source = [int(i) for i in section["feature_layers"]], "jaxspec.feature_layers"
    elif vllm_ids:
        layers, source = [int(i) - 1 for i in vllm_ids], f"eagle_aux_hidden_state_layer_ids {list(vllm_ids)} (vLLM)"
        if sglang_ids and sorted(int(i) for i in sglang_ids) != sorted(layers):
            warnings.warn(f"{where}: eagle_aux_hidden_state_layer_ids {list(vllm_ids)} (vLLM numbering: before layer "
                          f"k) and eagle_config's {list(sglang_ids)} (SGLang numbering: after layer k) name different "
                          "layers; using vLLM's.", UserWarning, stacklevel=3)
    elif sglang_ids:
        layers, source = [int(i) for i in sglang_ids], f"eagle_config.eagle_aux_hidden_state_layer_ids " \
                                                        f"{list(sglang_ids)} (SGLang)"
    else:
        layers, source = list(default_reference_layers(num_layers)), "the references' default (2, L//2, L-3)"
    if len(set(layers)) != len(layers):
        raise UserError(f"{where}: the feature layers from {source} repeat a layer; each must be fused once.")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"{where}: the feature layers from {source} are target layers {sorted(layers)} (counted "
                        f"from 0, the layer whose output is fused), but the target has layers 0..{num_layers - 1}; "
                        "this drafter was trained for a deeper target.")
    if len(layers) != n:
        raise UserError(f"{where}: fc.weight fuses {n} target layers, but {source} names {len(layers)}.")
    return tuple(sorted(layers))


def import_eagle3_hf(path: str | os.PathLike, target_cfg: ModelConfig, target_weights=None, *,
                     target_fingerprint: str | None = None) -> tuple[Eagle3Params, Eagle3Config]:
    """Reads an EAGLE-3 Llama drafter in the public Hugging Face format into float32 params for this target.

    Checks everything a wrong checkpoint would otherwise turn into garbage drafts or a crash: that the tensors are
    an EAGLE-3 head's, the widths and head counts against the target, the feature layers, and above all the
    vocabulary map (a drafter trained for another target's tokenizer). Draft ids keep the file's order.
    `embed_tokens.weight`, if present, is ignored (the target's embedding is used) after its shape is checked. The
    head keeps its own RoPE and epsilon (the config's `rope_theta`, `rope_scaling`, `rms_norm_eps`) and its
    per-layer feature norms (`fc_norm`), so it drafts as it did where it was trained.

    Args:
        path: the folder (config.json + model.safetensors, or shards with model.safetensors.index.json). Only
            safetensors: a pytorch_model.bin must be converted first (the error says how).
        target_cfg: the target's config.
        target_weights: the target's weights; needed only when the file has no lm_head.weight and drafts over the
            whole vocabulary (the target's LM head is then used, as SGLang does).
        target_fingerprint: `LoadedModel.fingerprint()` of the running target; a file exported by jaxspec for a
            different target is refused.
    Returns:
        (Eagle3Params float32, Eagle3Config with the feature layers, draft vocabulary and, when the file has a
        "jaxspec" section, its tree settings; otherwise the default tree).
    Raises:
        UserError: what is wrong with the folder and what to do.
    """
    from jaxspec.config_files import from_dict

    path = os.fspath(path)
    config, tensors = read_hf_folder(path)
    where = f"EAGLE-3 drafter {path}"
    d, v, big = target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_layers
    hq, hkv, h = target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim

    archs = config.get("architectures") or []
    if config.get("speculators_model_type") or "Eagle3Speculator" in archs:
        raise UserError(f"{where} is in the vLLM 'speculators' layout ({archs}); jaxspec reads the original "
                        f"EAGLE-3 layout ({ARCHITECTURES[0]}): use the checkpoint it was converted from.")
    # the tensors decide, not the name: EAGLE's own releases say LlamaForCausalLM (vLLM maps that name to its
    # EAGLE-3 class when the method is eagle3), SpecForge and SGLang LlamaForCausalLMEagle3
    if "fc.weight" not in tensors or not any(k.startswith("midlayer.") for k in tensors):
        raise UserError(f"{where} is not an EAGLE-3 draft head: it has no fc.weight and midlayer.* tensors (the "
                        f"fused-feature projection and the draft layer of every EAGLE-3 layout); config.json's "
                        f"architectures are {archs}. EAGLE-1/2 heads and other drafters have other layouts.")
    section = config.get(JAXSPEC_KEY) if isinstance(config.get(JAXSPEC_KEY), dict) else None
    if section and section.get("format_version", 0) > JAXSPEC_FORMAT_VERSION:
        raise UserError(f"{where} was exported by a newer jaxspec (format version {section['format_version']}); "
                        "upgrade jaxspec.")
    saved_fp = ((section or {}).get("target") or {}).get("fingerprint")
    if target_fingerprint is not None and saved_fp and saved_fp != target_fingerprint:
        source = (section.get("target") or {}).get("source")
        raise UserError(f"{where} was exported for another target ({source + ', ' if source else ''}fingerprint "
                        f"{saved_fp}), not for this one (fingerprint {target_fingerprint}); use the drafter made for "
                        "this target.")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{where} has {config['num_hidden_layers']} decoder layers; jaxspec's EAGLE-3 head has one.")
    if config.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where} uses activation {config['hidden_act']}; jaxspec's head is SwiGLU (silu).")
    if config.get("norm_output") is False:
        raise UserError(f"{where} sets norm_output false (SpecForge: its LM head reads the draft layer's output "
                        "without the final norm); jaxspec's head always applies the final norm, so it cannot run "
                        "this drafter as it was trained.")
    if config.get("norm_before_residual"):
        raise UserError(f"{where} sets norm_before_residual (the residual is the normed feature); jaxspec's head "
                        "adds the raw feature, as EAGLE and SGLang do, so it cannot run this drafter.")
    if isinstance(config.get("eagle_config"), dict) and config["eagle_config"].get("use_aux_hidden_state") is False:
        raise UserError(f"{where} does not fuse several target layers (eagle_config.use_aux_hidden_state false); "
                        "jaxspec imports EAGLE-3 heads with fc.")

    heads = int(config.get("num_attention_heads", hq))
    width = int(config.get("hidden_size", d))
    shapes = {"hidden_size": (width, d), "target_hidden_size": (int(config.get("target_hidden_size", width)), d),
              "num_attention_heads": (heads, hq),
              "num_key_value_heads": (int(config.get("num_key_value_heads") or heads), hkv),
              "head_dim": (int(config.get("head_dim") or width // max(heads, 1)), h)}
    wrong = [f"{k} {have} (the target: {want})" for k, (have, want) in shapes.items() if have != want]
    if wrong:
        raise UserError(f"{where} does not fit this target: {', '.join(wrong)}. jaxspec's head shares the target's "
                        "width, heads and KV cache layout; it was trained for another target.")
    if "vocab_size" in config and int(config["vocab_size"]) != v:
        raise UserError(f"{where} was built for a vocabulary of {int(config['vocab_size'])} tokens but the target has "
                        f"{v}; it was trained for another target (another tokenizer).")

    fc_norms = sorted(k for k in tensors if k.startswith("fc_norm."))
    known = {name for name, _ in _WEIGHTS.values()} | set(OPTIONAL_TENSORS) | set(fc_norms)
    unknown = sorted(k for k in tensors if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        more = " ..." if len(unknown) > 6 else ""
        raise UserError(f"{where} has tensors jaxspec's head does not have: {', '.join(unknown[:6])}{more} (biases or "
                        "extra layers?); it is not a plain EAGLE-3 Llama head.")
    missing = sorted(name for name, _ in _WEIGHTS.values() if name not in tensors and name != "lm_head.weight")
    if missing:
        raise UserError(f"{where} is missing tensors: {', '.join(missing)}.")
    for name, x in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        if x.dtype.kind != "f" and x.dtype != ml_dtypes.bfloat16:
            raise UserError(f"{where}: {name} has dtype {x.dtype}; weights must be floating point.")

    fc = tensors["fc.weight"]
    if fc.ndim != 2 or fc.shape[0] != d or fc.shape[1] % d:
        raise UserError(f"{where}: fc.weight has shape {_shape(fc)}; it must be [{d}, n x {d}] (n fused target "
                        f"layers of the target's width {d}), so this head was trained for a target of another "
                        "width.")
    n = fc.shape[1] // d
    wanted_norms = [f"fc_norm.{i}.weight" for i in range(n)]
    if fc_norms and sorted(fc_norms) != sorted(wanted_norms):
        raise UserError(f"{where} has per-layer feature norms {', '.join(fc_norms)}, but fc.weight fuses {n} layers: "
                        f"expected {', '.join(wanted_norms)}.")
    if config.get("fc_norm") and not fc_norms:
        raise UserError(f"{where} sets fc_norm (SpecForge's per-layer norms before fc) but has no fc_norm.*.weight "
                        "tensors; the files are incomplete.")
    if fc_norms and config.get("fc_norm") is False:
        raise UserError(f"{where} has fc_norm.*.weight tensors but config.json sets fc_norm false; SpecForge would "
                        "not apply them. The files do not belong together.")
    bad = [f"{k} {_shape(tensors[k])}" for k in fc_norms if _shape(tensors[k]) != (d,)]
    if bad:
        raise UserError(f"{where} does not fit this target: {'; '.join(bad)} (expected ({d},)).")
    f = int(tensors["midlayer.mlp.gate_proj.weight"].shape[0])
    if "intermediate_size" in config and int(config["intermediate_size"]) != f:
        raise UserError(f"{where}: config.json says intermediate_size {config['intermediate_size']} but "
                        f"midlayer.mlp.gate_proj.weight has {f} rows.")
    want = {"midlayer.input_layernorm.weight": (d,), "midlayer.hidden_norm.weight": (d,),
            "midlayer.self_attn.q_proj.weight": (hq * h, 2 * d), "midlayer.self_attn.k_proj.weight": (hkv * h, 2 * d),
            "midlayer.self_attn.v_proj.weight": (hkv * h, 2 * d), "midlayer.self_attn.o_proj.weight": (d, hq * h),
            "midlayer.post_attention_layernorm.weight": (d,), "midlayer.mlp.gate_proj.weight": (f, d),
            "midlayer.mlp.up_proj.weight": (f, d), "midlayer.mlp.down_proj.weight": (d, f), "norm.weight": (d,)}
    wrong = [f"{k} {_shape(tensors[k])} (expected {s})" for k, s in want.items() if _shape(tensors[k]) != s]
    if wrong:
        raise UserError(f"{where} does not fit this target: {'; '.join(wrong)}.")
    if "embed_tokens.weight" in tensors and _shape(tensors["embed_tokens.weight"]) != (v, d):
        raise UserError(f"{where}: embed_tokens.weight has shape {_shape(tensors['embed_tokens.weight'])}, but the "
                        f"target's embedding is [{v}, {d}]; it was trained for another target.")
    layers = _feature_layers(config, section, n, big, where)

    # the vocabulary map: d2t offsets (target id = draft id + d2t[draft id]); no d2t means the identity (vLLM)
    lm = tensors.get("lm_head.weight")
    vd_config = config.get("draft_vocab_size")
    if "d2t" in tensors:
        offsets = np.asarray(tensors["d2t"])
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
            raise UserError(f"{where}: d2t must be a 1-D integer tensor (offsets), got {offsets.dtype}"
                            f"{_shape(offsets)}.")
        targets = offsets.astype(np.int64) + np.arange(offsets.shape[0], dtype=np.int64)  # [Vd]
    else:
        size = int(vd_config) if vd_config is not None else (int(lm.shape[0]) if lm is not None else v)
        if size != v:
            raise UserError(f"{where} drafts over {size} tokens but has no d2t (draft-to-target map); without it "
                            f"draft ids are target ids, which needs the whole vocabulary ({v}).")
        targets = np.arange(v, dtype=np.int64)
    vd = int(targets.shape[0])
    if vd_config is not None and int(vd_config) != vd:
        raise UserError(f"{where}: d2t maps {vd} draft tokens but config.json's draft_vocab_size is "
                        f"{int(vd_config)}; the files do not belong together.")
    if lm is not None and (lm.ndim != 2 or _shape(lm) != (vd, d)):
        raise UserError(f"{where}: lm_head.weight has shape {_shape(lm)} but the draft vocabulary has {vd} tokens "
                        f"of width {d} (expected [{vd}, {d}]); the files do not belong together.")
    built_for = int(tensors["t2d"].shape[0]) if "t2d" in tensors else None
    if targets.size and targets.min() < 0:
        raise UserError(f"{where}: its draft-to-target map (d2t offsets) gives negative target ids; the file is "
                        "corrupt.")
    if targets.size and targets.max() >= v:
        top = int(targets.max())
        size = built_for if built_for is not None and built_for > top else f"at least {top + 1}"
        raise UserError(f"This drafter's draft-to-target map (d2t) was built for a vocabulary of {size} tokens but "
                        f"the target has {v}: it maps draft tokens to target ids up to {top}. It was trained "
                        f"for another target; use the EAGLE-3 drafter made for this model ({where}).")
    if len(np.unique(targets)) != vd:
        raise UserError(f"{where}: its draft-to-target map (d2t) sends several draft tokens to the same target "
                        "token; the file is corrupt.")
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"])
        if t2d.ndim != 1 or t2d.dtype.kind not in "biu":
            raise UserError(f"{where}: t2d must be a 1-D boolean tensor, got {t2d.dtype}{_shape(t2d)}.")
        if t2d.shape[0] != v:
            raise UserError(f"This drafter's target-to-draft map (t2d) was built for a vocabulary of {t2d.shape[0]} "
                            f"tokens but the target has {v}; it was trained for another target (another "
                            f"tokenizer). Use the EAGLE-3 drafter made for this model ({where}).")
        marked = set(np.flatnonzero(t2d).tolist())
        if marked != set(targets.tolist()):
            raise UserError(f"{where}: t2d marks {len(marked)} target tokens and d2t maps to {vd}, and the two sets "
                            "differ; the vocabulary map is inconsistent (files from different trainings?).")

    if lm is None:
        if vd != v:
            raise UserError(f"{where} has no lm_head.weight and a reduced draft vocabulary ({vd} of {v} tokens); "
                            "only a head over the whole vocabulary can borrow the target's LM head.")
        if target_weights is None:
            raise UserError(f"{where} has no lm_head.weight: it uses the target's LM head; pass target_weights.")
        shared = target_weights.embed.T if target_weights.lm_head is None else target_weights.lm_head  # [d, V]
        tensors = {**tensors, "lm_head.weight": np.asarray(jax.device_get(shared), np.float32)[:, targets].T}

    theta, rope, eps = head_rope_and_eps(config, where)  # the head runs as its trainers ran it

    params = hf_to_params(tensors, targets, hq, hkv, h)
    settings = dict((section or {}).get("drafter") or {})
    settings.update(feature_layers=list(layers), draft_vocab_size=vd, rope_theta=theta,
                    rope_scaling=dataclasses.asdict(rope), rms_norm_eps=eps, feature_norm=bool(fc_norms))
    try:
        mcfg = from_dict(Eagle3Config, settings, path="jaxspec.drafter")
    except UserError as e:
        raise UserError(f"{where}: the jaxspec section of config.json does not fit this jaxspec ({e}).") from None
    return params, mcfg.for_target(target_cfg)


__all__ = ["ARCHITECTURES", "default_reference_layers", "export_eagle3_hf", "head_rope_and_eps",
           "hf_to_params", "import_eagle3_hf", "params_to_hf", "read_hf_folder", "rope_scaling_for_export",
           "sort_draft_vocab", "to_sglang_ids", "to_vllm_ids"]
