"""Model configurations: frozen, hashable, static dataclasses built from a HF config.json or GGUF metadata.

Everything that changes an array shape lives here; a config is passed to `jax.jit` as a static argument.
Supported families: Llama (Llama 2/3, SmolLM2), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3 with
a mixture of experts in place of each MLP), Gemma 3 (sliding-window
and global layers with a RoPE base each, GeGLU, a norm before and after each sublayer, a scaled embedding).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxspec.errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "gemma3")
# Hugging Face model_type -> architecture (Gemma 3's text model is "gemma3_text"; a multimodal "gemma3" folder holds
# one under text_config, read by `from_hf_config`).
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "gemma3_text": "gemma3"}
# their language model's model_type
MULTIMODAL_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3",
                      "qwen35": "qwen3_5", "qwen35moe": "qwen3_5"}
HIDDEN_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF hidden_act -> jaxspec's name
SLIDING, FULL = "sliding_attention", "full_attention"  # the layer types of a model with sliding-window layers
LINEAR = "linear_attention"  # a Gated DeltaNet layer of a hybrid model (Qwen3.5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "default" | "linear" | "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape-defining description of a decoder-only transformer."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen3_5" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 (the defaults are every other family's)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    embedding_multiplier: float = 1.0  # token embeddings are scaled by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power; None: head_dim's
    sandwich_norms: bool = False  # a norm on each sublayer's output too, before the residual add (Gemma)
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () when every layer is full attention
    sliding_window: int | None = None  # a sliding layer's query at position p sees the keys at (p - window, p]
    sliding_rope_theta: float | None = None  # the sliding layers' RoPE base (unscaled); rope_* are the full ones'
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU experts of width moe_intermediate_size,
    # of which a router picks num_experts_per_tok per token (0 experts: a dense MLP of width intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' router probabilities renormalised to sum to 1
    # Qwen3.5-MoE: a shared expert of this width beside the routed ones, every token through it, its output scaled
    # by sigmoid(x . shared_expert_gate) (0: none)
    shared_expert_intermediate_size: int = 0
    # Hybrid linear attention (Qwen3.5): the LINEAR layers are Gated DeltaNets (jaxspec.gated_delta) with these
    # head counts and dims and a causal conv of `linear_conv_kernel` taps; its attention layers gate their output
    # and rotate only the first partial_rotary_factor of each head
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    partial_rotary_factor: float = 1.0
    attention_output_gate: bool = False

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            known = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UserError(f"Architecture '{self.architecture}' is not supported; jaxspec runs {known}.")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}.")
        if self.hidden_act not in HIDDEN_ACTIVATIONS.values():
            raise UserError(f"hidden_act '{self.hidden_act}' is not supported; jaxspec runs silu and gelu_tanh.")
        if self.layer_types:
            unknown = sorted(set(self.layer_types) - {SLIDING, FULL, LINEAR})
            if unknown or len(self.layer_types) != self.num_layers:
                raise UserError(f"layer_types must name {SLIDING}, {FULL} or {LINEAR} for each of the "
                                f"{self.num_layers} layers; got {list(self.layer_types)}.")
            if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_rope_theta):
                raise UserError("A config with sliding-window layers needs sliding_window and their RoPE base.")
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise UserError("shared_expert_intermediate_size needs a mixture of experts (num_experts > 0).")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts="
                            f"{self.num_experts}.")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within the sliding window (all False for a model without such layers)."""
        return tuple(kind == SLIDING for kind in self.layer_types) or (False,) * self.num_layers

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a linear-attention (Gated DeltaNet) layer rather than attention."""
        return tuple(kind == LINEAR for kind in self.layer_types) or (False,) * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (recurrent state in the cache, beside the attention KV)."""
        return any(self.linear_layers)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a key/value cache."""
        return self.num_layers - sum(self.linear_layers)

    @property
    def linear_conv_channels(self) -> int:
        """C: the channels of a linear-attention layer's conv (its q, k and v before the recurrence)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def attention_scale(self) -> float:
        """What the query-key products are multiplied by: query_pre_attn_scalar ** -0.5, by default head_dim's."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Number of weights, the embedding counted once when it is tied to the output."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * (3 if self.attention_output_gate else 2) + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        attn += 2 * hd if self.qk_norm else 0
        hv, dv = self.linear_num_value_heads, self.linear_value_head_dim
        c = self.linear_conv_channels
        # a Gated DeltaNet layer: in_proj_qkv, in_proj_z, in_proj_b and _a, conv, dt_bias, A_log, norm, out_proj
        linear = d * c + d * hv * dv + 2 * d * hv + c * self.linear_conv_kernel + 2 * hv + dv + hv * dv * d
        mlp = self.num_experts * (3 * d * self.moe_intermediate_size + d) if self.num_experts else 3 * d * f
        if self.shared_expert_intermediate_size:
            mlp += 3 * d * self.shared_expert_intermediate_size + d
        norms = (4 if self.sandwich_norms else 2) * d
        num_linear = sum(self.linear_layers)
        layers = (self.num_layers - num_linear) * attn + num_linear * linear + self.num_layers * (mlp + norms)
        out = 0 if self.tie_word_embeddings else self.vocab_size * d
        return layers + self.vocab_size * d + d + out

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Builds a config from the dict of a Hugging Face `config.json`."""
        model_type = raw.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise UserError(
                f"model_type '{model_type}' in config.json is not supported; jaxspec runs "
                f"{', '.join(HF_MODEL_TYPES)} (and the text model of gemma3 folders)."
            )
        architecture = HF_MODEL_TYPES[model_type]
        act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        if architecture == "gemma3":  # Gemma names it hidden_activation; a hidden_act left beside it is ignored
            act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in HIDDEN_ACTIVATIONS:
            raise UserError(f"hidden_act '{act}' is not supported; jaxspec runs {', '.join(HIDDEN_ACTIVATIONS)}.")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise UserError(f"config.json sets {key}={raw[key]}; jaxspec does not apply logit soft-capping "
                                "(Gemma 2 uses it; Gemma 3 does not).")
        if architecture == "qwen3_moe":
            if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
                raise UserError("config.json has dense MLP layers among the expert layers (mlp_only_layers="
                                f"{raw.get('mlp_only_layers')}, decoder_sparse_step={raw.get('decoder_sparse_step')}); "
                                "jaxspec runs Qwen3-MoE models whose every layer is a mixture of experts.")
            if raw.get("use_sliding_window"):
                raise UserError("config.json sets use_sliding_window for a Qwen3-MoE model; jaxspec does not run it.")
        if raw.get("use_bidirectional_attention"):
            raise UserError("config.json sets use_bidirectional_attention: an encoder, not a decoder jaxspec runs.")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        layer_types = tuple(raw.get("layer_types") or ()) if architecture in ("gemma3", "qwen3_5") else ()
        sliding_theta = None
        if FULL in rope_params or SLIDING in rope_params:  # one RoPE per layer type (Gemma 3)
            sliding = rope_params.get(SLIDING) or {}
            if sliding.get("rope_type", "default") != "default":
                raise UserError(f"RoPE scaling '{sliding['rope_type']}' on the sliding layers is not supported.")
            sliding_theta = float(sliding.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
            rope_params = rope_params.get(FULL) or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        gemma = architecture == "gemma3"
        linear = {}
        if architecture == "qwen3_5":
            linear = dict(linear_num_key_heads=int(raw["linear_num_key_heads"]),
                          linear_num_value_heads=int(raw["linear_num_value_heads"]),
                          linear_key_head_dim=int(raw["linear_key_head_dim"]),
                          linear_value_head_dim=int(raw["linear_value_head_dim"]),
                          linear_conv_kernel=int(raw["linear_conv_kernel_dim"]),
                          partial_rotary_factor=float(rope_params.get("partial_rotary_factor",
                                                                      raw.get("partial_rotary_factor", 0.25))),
                          attention_output_gate=True)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            # a Qwen3.5-MoE config has no dense width: its shared expert's stands in (unused by the forward)
            intermediate_size=raw.get("intermediate_size") or raw["shared_expert_intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling_from_hf(rope_params),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=architecture in ("qwen3", "qwen3_moe", "qwen3_5") or gemma,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=HIDDEN_ACTIVATIONS[act],
            embedding_multiplier=float(raw["hidden_size"]) ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
            sandwich_norms=gemma,
            layer_types=layer_types,
            sliding_window=raw.get("sliding_window") if SLIDING in layer_types else None,
            sliding_rope_theta=sliding_theta if SLIDING in layer_types else None,
            **_experts_from_hf(raw, architecture),
            **linear,
        )

    @classmethod
    def from_hf_config(cls, path: str) -> ModelConfig:
        """Builds a config from a Hugging Face folder (or a config.json path).

        transformers' AutoConfig (no torch) validates and fills defaults; the result is read as a dict.
        """
        folder = os.path.dirname(path) if path.endswith(".json") else path
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise UserError(f"No config.json in '{folder}': a Hugging Face model folder needs one.")
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
        multimodal = raw.get("model_type") in MULTIMODAL_MODEL_TYPES and "text_config" in raw  # vision + text
        if raw.get("model_type") in HF_MODEL_TYPES or multimodal:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(folder, local_files_only=True)
            merged = hf.to_dict()
            merged.update({k: v for k, v in raw.items() if k not in merged})
            raw = merged
        if multimodal:
            raw = {**raw["text_config"], "model_type": MULTIMODAL_MODEL_TYPES[raw["model_type"]]}
        return cls.from_hf_dict(raw)

    @classmethod
    def from_gguf(cls, reader) -> ModelConfig:
        """Builds a config from the metadata of a `jaxspec.gguf_file.GGUFFile`."""
        meta = reader.metadata
        gguf_arch = meta.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UserError(
                f"GGUF architecture '{gguf_arch}' is not supported; jaxspec runs {', '.join(GGUF_ARCHITECTURES)}."
            )
        arch = GGUF_ARCHITECTURES[gguf_arch]

        def get(key, default=None):
            return meta.get(f"{gguf_arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // num_heads))
        vocab = get("vocab_size")
        names = {t.name for t in reader.tensors}
        if vocab is None and "tokenizer.ggml.tokens" in meta:
            vocab = len(meta["tokenizer.ggml.tokens"])
        elif vocab is None:  # a file written without a vocabulary: the embedding's rows (ggml's ne lists d first)
            vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
        scaling = RopeScaling()
        kind = get("rope.scaling.type")
        if kind == "linear":
            scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
        elif kind not in (None, "none"):
            raise UserError(f"GGUF rope scaling '{kind}' is not supported (default, linear and llama3 are).")
        if "rope_freqs.weight" in names:
            raise UserError(
                "This GGUF stores precomputed RoPE frequency factors (llama3 scaling); load the Hugging Face folder "
                "of the model instead, whose config.json describes the scaling."
            )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        gemma = {}
        if arch == "gemma3":
            # What llama.cpp fixes for Gemma 3 rather than storing: every 6th layer global, the others sliding with
            # RoPE base 1e4, and scores scaled by head_dim ** -0.5 except in the 27B (62 layers: hidden/heads).
            num_layers = int(get("block_count"))
            gemma = dict(
                hidden_act="gelu_tanh",
                embedding_multiplier=float(hidden) ** 0.5,
                query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
                sandwich_norms=True,
                layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)),
                sliding_window=int(get("attention.sliding_window")),
                sliding_rope_theta=10000.0,
            )
        hybrid = {}
        if arch == "qwen3_5":
            # llama.cpp's ssm.* keys: state_size is the key head dim, group_count the key heads, time_step_rank the
            # value heads, inner_size value heads x value head dim. The layer kinds come from the tensors a layer
            # has (attn_qkv: Gated DeltaNet), not from full_attention_interval, which the converter writes as 4
            # whenever config.json does not name it, whatever the layer_types said.
            value_heads = int(get("ssm.time_step_rank"))
            hybrid = dict(
                layer_types=tuple(LINEAR if f"blk.{i}.attn_qkv.weight" in names else FULL
                                  for i in range(int(get("block_count")))),
                linear_num_key_heads=int(get("ssm.group_count")), linear_num_value_heads=value_heads,
                linear_key_head_dim=int(get("ssm.state_size")),
                linear_value_head_dim=int(get("ssm.inner_size")) // value_heads,
                linear_conv_kernel=int(get("ssm.conv_kernel")),
                partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
                attention_output_gate=True,
            )
        experts = {}
        if gguf_arch in ("qwen3moe", "qwen35moe"):  # llama.cpp always renormalises the chosen experts' weights
            experts = dict(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                           moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True,
                           shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)))
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            # a Qwen3.5-MoE file has no dense width: its shared expert's stands in, as for its config.json
            intermediate_size=int(get("feed_forward_length") or get("expert_shared_feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm=any(name.endswith(".attn_q_norm.weight") for name in names),  # block 0 may be a linear layer
            max_position_embeddings=int(get("context_length", 4096)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **gemma,
            **experts,
            **hybrid,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a Hugging Face config.json dict (inverse of `from_hf_dict`)."""
        rope = None
        if self.rope_scaling.kind == "linear":
            rope = {"rope_type": "linear", "factor": self.rope_scaling.factor}
        elif self.rope_scaling.kind == "llama3":
            s = self.rope_scaling
            rope = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }
        eos = list(self.eos_token_ids)
        extra = {}
        if self.architecture == "gemma3":  # Gemma 3's own keys (other families' dicts stay as they were)
            extra = {
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": self.query_pre_attn_scalar,
                "layer_types": list(self.layer_types),
                "sliding_window": self.sliding_window,
                "rope_parameters": {FULL: {"rope_type": "default", **(rope or {}), "rope_theta": self.rope_theta},
                                    SLIDING: {"rope_type": "default", "rope_theta": self.sliding_rope_theta}},
            }
            rope = None
        if self.architecture == "qwen3_5":
            extra |= {"layer_types": list(self.layer_types), "linear_num_key_heads": self.linear_num_key_heads,
                     "linear_num_value_heads": self.linear_num_value_heads,
                     "linear_key_head_dim": self.linear_key_head_dim,
                     "linear_value_head_dim": self.linear_value_head_dim,
                     "linear_conv_kernel_dim": self.linear_conv_kernel,
                     "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                         "partial_rotary_factor": self.partial_rotary_factor}}
        if self.num_experts:
            extra |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                      "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob}
        if self.shared_expert_intermediate_size:
            extra["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        model_type = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}.get(self.architecture, self.architecture)
        if self.architecture == "qwen3_5" and self.num_experts:
            model_type = "qwen3_5_moe_text"
        return {
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "hidden_act": "silu",
            **extra,
        }


def _experts_from_hf(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (transformers 5 writes num_experts as num_local_experts)."""
    if architecture == "qwen3_5" and raw.get("num_experts"):  # Qwen3.5-MoE: its router always renormalises
        return dict(num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]), norm_topk_prob=True,
                    shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))
    if architecture != "qwen3_moe":
        return {}
    return dict(num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


def _rope_scaling_from_hf(params: dict[str, Any]) -> RopeScaling:
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise UserError(f"RoPE scaling '{kind}' is not supported (default, linear and llama3 are).")


# Known small configs used by tests and eval_shape checks.
LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position=8192),
    max_position_embeddings=131072,
)
QWEN3_8B = ModelConfig(
    architecture="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
    max_position_embeddings=40960,
)
