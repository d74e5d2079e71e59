"""EAGLE-3 drafters in the public Hugging Face format (jaxspec/drafters/eagle_hf.py), on the tiny Llama-3.

The tensor names, torch shapes and the forward the file must mean are written here from the reference code
(SafeAILab/EAGLE eagle/traineagle3/cnets.py, sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py,
vllm-project/vllm vllm/model_executor/models/llama_eagle3.py, sgl-project/sglang
python/sglang/srt/models/llama_eagle3.py), not from the export function."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.cache import init_cache
from jaxspec.config import RopeScaling
from jaxspec.drafters.base import RoundInputs
from jaxspec.drafters.eagle import (
    Eagle3Config,
    absorb_pairs,
    draft_tree,
    fuse_features,
    head_forward,
    head_logits,
    to_target_logits,
)
from jaxspec.drafters.eagle_hf import export_eagle3_hf, import_eagle3_hf, sort_draft_vocab
from jaxspec.errors import UserError
from jaxspec.model import forward, rope_inverse_frequencies
from jaxspec.sampling import SamplingConfig
from jaxspec.speculative import speculative_generate

# The tiny Llama-3: d 64, 4 query heads and 2 KV heads of width 16, FFN 128, 3 layers, vocabulary 256; the head
# drafts over Vd = 128 tokens. torch's nn.Linear(in, out).weight is [out, in].
EXPECTED_TENSORS = {
    "fc.weight": ((64, 192), "BF16"),  # Linear(3 d, d)
    "midlayer.input_layernorm.weight": ((64,), "BF16"),
    "midlayer.hidden_norm.weight": ((64,), "BF16"),
    "midlayer.self_attn.q_proj.weight": ((64, 128), "BF16"),  # Linear(2 d, Hq h)
    "midlayer.self_attn.k_proj.weight": ((32, 128), "BF16"),  # Linear(2 d, Hkv h)
    "midlayer.self_attn.v_proj.weight": ((32, 128), "BF16"),
    "midlayer.self_attn.o_proj.weight": ((64, 64), "BF16"),  # Linear(Hq h, d)
    "midlayer.post_attention_layernorm.weight": ((64,), "BF16"),
    "midlayer.mlp.gate_proj.weight": ((128, 64), "BF16"),  # Linear(d, f)
    "midlayer.mlp.up_proj.weight": ((128, 64), "BF16"),
    "midlayer.mlp.down_proj.weight": ((64, 128), "BF16"),  # Linear(f, d)
    "norm.weight": ((64,), "BF16"),
    "lm_head.weight": ((128, 64), "BF16"),  # Linear(d, Vd)
    "d2t": ((128,), "I64"),  # offsets: target id = draft id + d2t[draft id]
    "t2d": ((256,), "BOOL"),  # over the target vocabulary
}


def _head(model, vocab=128, **settings):
    """A random head (random norms too, so no two [d] tensors are alike) with a frequency-ordered vocabulary map."""
    cfg = Eagle3Config(draft_vocab_size=vocab, init_scale=0.3, depth=3, top_k=3, num_nodes=8, **settings)
    cfg = cfg.for_target(model.config)
    counts = np.random.default_rng(0).integers(0, 50, model.config.vocab_size)
    params = cfg.init_params(model.config, model.weights, jax.random.key(7), counts)
    keys = iter(jax.random.split(jax.random.key(3), 4))
    norms = {k: 1 + 0.3 * jax.random.normal(next(keys), (64,)) for k in ("input_norm", "hidden_norm", "mlp_norm",
                                                                           "final_norm")}
    return cfg, dataclasses.replace(params, **norms)


def _export(path, params, cfg, model, **kwargs):
    """Export; the tiny target's default feature layers include its last one, which export warns about."""
    with pytest.warns(UserWarning, match="last layer"):
        return export_eagle3_hf(path, params, cfg, model.config, **kwargs)


def _header(path):
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def _assert_params_equal(a, b):
    for field in dataclasses.fields(a):
        np.testing.assert_array_equal(np.asarray(getattr(a, field.name)), np.asarray(getattr(b, field.name)),
                                      err_msg=field.name)


def test_round_trip(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    assert not np.all(np.diff(np.asarray(params.d2t)) > 0)  # frequency order: the export must reorder
    _export(tmp_path / "f32", params, cfg, model, dtype="float32", target_fingerprint=model.fingerprint())
    back, back_cfg = import_eagle3_hf(tmp_path / "f32", model.config, target_fingerprint=model.fingerprint())
    expected = sort_draft_vocab(params)  # the references' order: by target id
    assert np.all(np.diff(np.asarray(expected.d2t)) > 0)
    _assert_params_equal(back, expected)
    assert back.wq.dtype == jnp.float32 and back.d2t.dtype == jnp.float32
    assert back_cfg == cfg  # tree settings, feature layers and vocabulary size come back from the jaxspec section
    # exporting what was imported writes the same tensors
    _export(tmp_path / "again", back, back_cfg, model, dtype="float32")
    first, second = load_file(tmp_path / "f32/model.safetensors"), load_file(tmp_path / "again/model.safetensors")
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)

    _export(tmp_path / "bf16", params, cfg, model)  # bfloat16, the public checkpoints' dtype
    bf16, _ = import_eagle3_hf(tmp_path / "bf16", model.config)
    rounded = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), expected)
    _assert_params_equal(dataclasses.replace(bf16, d2t=expected.d2t), dataclasses.replace(rounded, d2t=expected.d2t))
    np.testing.assert_array_equal(np.asarray(bf16.d2t), np.asarray(expected.d2t))  # ids stay exact
    with pytest.raises(UserError, match="another target"):
        import_eagle3_hf(tmp_path / "f32", model.config, target_fingerprint="0123456789abcdef")


def test_reimported_head_drafts_the_same_trees(tiny_llama3, tmp_path):
    _, model, ref = tiny_llama3
    cfg, params = _head(model)
    _export(tmp_path / "head", params, cfg, model, dtype="float32")
    back, back_cfg = import_eagle3_hf(tmp_path / "head", model.config)
    drafter = cfg.make_drafter()
    assert back_cfg.make_drafter() == drafter

    # one round's tree from the prompt, by hand
    cfg_t, w = model.config, model.weights
    prompt = ref["input_ids"][0, :12].tolist()
    out = forward(w, cfg_t, jnp.asarray([prompt]), jnp.arange(12)[None], hidden_layers=drafter.target_layers)
    trees = []
    for p in (params, back):
        cache = init_cache(cfg_t, 1, 32, num_layers=1)
        feats = jnp.pad(fuse_features(p, out.hidden), ((0, 0), (0, 20), (0, 0)))
        history = jnp.pad(jnp.asarray([prompt + [7]]), ((0, 0), (0, 19)))
        cache, h_root = absorb_pairs(p, cfg_t, w.embed, cache, feats, history, jnp.array([12]))
        tree, scores = draft_tree(p, cfg_t, w.embed, cache, h_root, depth=3, top_k=3, num_nodes=8)
        trees.append((np.asarray(tree.tokens), np.asarray(tree.parents), np.asarray(scores)))
    np.testing.assert_array_equal(trees[0][0], trees[1][0])
    np.testing.assert_array_equal(trees[0][1], trees[1][1])
    np.testing.assert_allclose(trees[0][2], trees[1][2], rtol=1e-5, atol=1e-6)

    # whole generation: the same tokens and the same accepted drafts in every round
    prompts = [ref["input_ids"][0, :5].tolist(), ref["input_ids"][1, :17].tolist()]
    runs = [speculative_generate(w, cfg_t, drafter, p, prompts, max_new_tokens=16, eos_ids=()) for p in (params, back)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].accepted == runs[1].accepted


def test_file_has_the_reference_names_shapes_and_offsets(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    _export(tmp_path / "head", params, cfg, model)
    header = _header(tmp_path / "head/model.safetensors")
    header.pop("__metadata__", None)
    assert {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items()} == EXPECTED_TENSORS
    tensors = load_file(tmp_path / "head/model.safetensors")
    ids = np.sort(np.rint(np.asarray(params.d2t)).astype(np.int64))  # the draft vocabulary, by target id
    np.testing.assert_array_equal(tensors["d2t"], ids - np.arange(128))  # offsets, not ids
    assert np.all(tensors["d2t"] >= 0)
    np.testing.assert_array_equal(np.flatnonzero(tensors["t2d"]), ids)
    with open(tmp_path / "head/config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    want = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=1, vocab_size=256, draft_vocab_size=128, rms_norm_eps=1e-6, rope_theta=500000.0)
    assert {k: config[k] for k in want} == want
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: the stream before layer k
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1
    assert config["jaxspec"]["feature_layers"] == [0, 1, 2]


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _reference_logits(t, config, emb, aux, inv_freq):
    """The EAGLE-3 draft layer as the reference code computes it (cnets.py `LlamaDecoderLayeremb` and `Model`,
    SGLang's `LlamaDecoderLayer`, vLLM's `compute_logits`), in float64 numpy on the file's tensors, for one
    sequence without a cache: emb [T, d] the next tokens' embeddings, aux [T, 3d] the fused target states -> logits
    over the target vocabulary [T, V] (-inf outside the draft vocabulary)."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, hq, hkv, hd = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    n = emb.shape[0]

    def lin(x, name):
        return x @ t[name].T

    if "fc_norm.0.weight" in t:  # SpecForge's project_hidden_states: a norm on each fused layer's chunk, then fc
        aux = np.concatenate([_rms(c, t[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(np.split(aux, 3, -1))], -1)
    h = lin(aux, "fc.weight")
    residual = h
    x = np.concatenate([_rms(emb, t["midlayer.input_layernorm.weight"], eps),
                        _rms(h, t["midlayer.hidden_norm.weight"], eps)], -1)  # embedding first
    q = lin(x, "midlayer.self_attn.q_proj.weight").reshape(n, hq, hd)
    k = lin(x, "midlayer.self_attn.k_proj.weight").reshape(n, hkv, hd)
    v = lin(x, "midlayer.self_attn.v_proj.weight").reshape(n, hkv, hd)
    angles = np.arange(n)[:, None] * np.asarray(inv_freq, np.float64)[None]  # [T, hd/2]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]

    def rotate_half(z):
        return np.concatenate([-z[..., hd // 2:], z[..., :hd // 2]], -1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # repeat_kv
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + np.where(np.tri(n) > 0, 0.0, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", probs, v).reshape(n, hq * hd)
    h = residual + lin(attn, "midlayer.self_attn.o_proj.weight")
    y = _rms(h, t["midlayer.post_attention_layernorm.weight"], eps)
    gate = lin(y, "midlayer.mlp.gate_proj.weight")
    h = h + lin(gate / (1 + np.exp(-gate)) * lin(y, "midlayer.mlp.up_proj.weight"), "midlayer.mlp.down_proj.weight")
    logits = lin(_rms(h, t["norm.weight"], eps), "lm_head.weight")  # [T, Vd]
    full = np.full((n, config["vocab_size"]), -np.inf)
    full[:, np.arange(logits.shape[1]) + t["d2t"].astype(np.int64)] = logits  # vLLM: targets = base + d2t
    return full


def test_the_file_means_what_the_head_computes(tiny_llama3, tmp_path):
    """The reference forward on the exported file (target states tapped at the ids config.json gives, in vLLM's
    and in SGLang's numbering) equals jaxspec's head on the original params, which fuse layers given out of order."""
    _, model, ref = tiny_llama3
    cfg, params = _head(model, feature_layers=(2, 0, 1))
    _export(tmp_path / "head", params, cfg, model, dtype="float32")
    tensors = load_file(tmp_path / "head/model.safetensors")
    with open(tmp_path / "head/config.json") as f:
        config = json.load(f)
    cfg_t, w = model.config, model.weights
    tokens = jnp.asarray([ref["input_ids"][1, :14].tolist()])  # x_0 .. x_13: pairs (state t, token t + 1)
    n = 13
    out = forward(w, cfg_t, tokens[:, :n], jnp.arange(n)[None], hidden_layers=(0, 1, 2))
    stream = [np.asarray(w.embed[tokens[0, :n]])] + [np.asarray(x[0]) for x in out.hidden]  # [k]: before layer k
    vllm = np.concatenate([stream[k] for k in config["eagle_aux_hidden_state_layer_ids"]], -1)
    sglang = np.concatenate([stream[k + 1] for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], -1)
    np.testing.assert_array_equal(vllm, sglang)
    expected = _reference_logits(tensors, config, np.asarray(w.embed[tokens[0, 1:]]), vllm,
                                 rope_inverse_frequencies(cfg_t))

    ours_out = forward(w, cfg_t, tokens[:, :n], jnp.arange(n)[None], hidden_layers=cfg.feature_layers)
    h, _, _ = head_forward(params, cfg_t, w.embed, tokens[:, 1:], fuse_features(params, ours_out.hidden),
                           jnp.arange(n)[None])
    ours = np.asarray(to_target_logits(params, head_logits(params, cfg_t, h), 256))[0]
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(ours[finite], expected[finite], rtol=1e-3, atol=1e-3)


def _variant(src, dst, edit):
    """A copy of an exported folder with config.json and the tensors passed through edit(config, tensors)."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(config, tensors)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def _swap_one(t2d):
    marked, unmarked = np.flatnonzero(t2d)[0], np.flatnonzero(~t2d)[0]
    t2d = t2d.copy()
    t2d[marked], t2d[unmarked] = False, True
    return t2d


Q = "midlayer.self_attn.q_proj.weight"
REFUSALS = {
    "t2d of another vocabulary": (lambda c, t: t.update(t2d=np.concatenate([t["t2d"], np.zeros(44, np.bool_)])),
                                  "t2d\\) was built for a vocabulary of 300 tokens but the target has 256"),
    "d2t past the vocabulary": (lambda c, t: t.update(d2t=np.concatenate([t["d2t"][:-1], t["d2t"][-1:] + 300])),
                                "d2t\\) was built for a vocabulary of at least .* tokens but the target has 256"),
    "d2t of the wrong length": (lambda c, t: t.update(d2t=t["d2t"][:100]),
                                "d2t maps 100 draft tokens but config.json's draft_vocab_size is 128"),
    "t2d disagreeing with d2t": (lambda c, t: t.update(t2d=_swap_one(t["t2d"])), "inconsistent"),
    "another tokenizer": (lambda c, t: c.update(vocab_size=128256),
                          "built for a vocabulary of 128256 tokens but the target has 256"),
    "head width": (lambda c, t: c.update(num_attention_heads=2, head_dim=32), "head_dim 32 \\(the target: 16\\)"),
    "q_proj of other heads": (lambda c, t: t.update({Q: t[Q][:32]}), "q_proj.weight \\(32, 128\\)"),
    "fc not a multiple of d": (lambda c, t: t.update({"fc.weight": t["fc.weight"][:, :150]}),
                               "fc.weight has shape \\(64, 150\\)"),
    "not an EAGLE-3 head": (lambda c, t: t.pop("fc.weight"), "not an EAGLE-3 draft head: it has no fc.weight"),
    "SpecForge's norm_output false": (lambda c, t: c.update(norm_output=False), "norm_output false"),
    "fc_norm set without its tensors": (lambda c, t: c.update(fc_norm=True), "no fc_norm"),
    "fc_norm tensors of the wrong count": (lambda c, t: t.update({"fc_norm.0.weight": np.ones(64, np.float32)}),
                                           "expected fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight"),
    "RoPE scaling jaxspec cannot run": (lambda c, t: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
                                        "RoPE scaling 'dynamic'"),
    "feature layer out of range": (lambda c, t: c.update(jaxspec={}, eagle_aux_hidden_state_layer_ids=[1, 2, 9],
                                                          eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 8]}),
                                   "target has layers 0..2"),
    "embedding of another target": (lambda c, t: t.update({"embed_tokens.weight": np.zeros((255, 64), np.float32)}),
                                    "embed_tokens.weight has shape \\(255, 64\\)"),
    "biases": (lambda c, t: t.update({"midlayer.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
               "does not have: midlayer.self_attn.q_proj.bias"),
}


@pytest.fixture(scope="module")
def exported(tiny_llama3, tmp_path_factory):
    """A float32 export of a random head, for the refusal variants."""
    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    return _export(tmp_path_factory.mktemp("exported") / "head", params, cfg, model, dtype="float32")


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(tiny_llama3, exported, tmp_path, case):
    _, model, _ = tiny_llama3
    edit, message = REFUSALS[case]
    folder = _variant(exported, tmp_path / "head", edit)
    with pytest.raises(UserError, match=message):
        import_eagle3_hf(folder, model.config)


def test_public_checkpoints_without_our_section(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    _export(tmp_path / "head", params, cfg, model, dtype="float32")

    def sglang_style(c, t):  # no jaxspec section, no vLLM key, the draft's own RoPE left at HF's default
        for key in ("jaxspec", "eagle_aux_hidden_state_layer_ids", "rope_theta", "rope_scaling"):
            c.pop(key)

    folder = _variant(tmp_path / "head", tmp_path / "public", sglang_style)
    back, back_cfg = import_eagle3_hf(folder, model.config)
    _assert_params_equal(back, sort_draft_vocab(params))
    # the default tree, and the head's own RoPE: HF's default base 10000 without scaling (not the target's 500000)
    assert back_cfg == Eagle3Config(feature_layers=(0, 1, 2), draft_vocab_size=128, rope_theta=10000.0,
                                    rope_scaling=RopeScaling(), rms_norm_eps=1e-6)

    # no layer ids at all: the references' default taps (before layers 2, L//2, L-3) include the embedding here
    folder = _variant(folder, tmp_path / "no-ids", lambda c, t: c.pop("eagle_config"))
    with pytest.raises(UserError, match="references' default"):
        import_eagle3_hf(folder, model.config)

    # only pytorch_model.bin
    os.makedirs(tmp_path / "bin")
    shutil.copy(tmp_path / "head/config.json", tmp_path / "bin/config.json")
    (tmp_path / "bin/pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="reads only safetensors"):
        import_eagle3_hf(tmp_path / "bin", model.config)


def test_whole_vocabulary_head_without_lm_head_borrows_the_target_s(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    cfg, params = _head(model, vocab=0)
    _export(tmp_path / "head", params, cfg, model, dtype="float32")

    def no_head(c, t):  # SGLang: draft_vocab_size None -> the target's LM head; no map -> identity
        for key in ("lm_head.weight", "d2t", "t2d"):
            t.pop(key)
        c.pop("draft_vocab_size")

    folder = _variant(tmp_path / "head", tmp_path / "no-head", no_head)
    back, _ = import_eagle3_hf(folder, model.config, model.weights)
    np.testing.assert_array_equal(np.asarray(back.lm_head), np.asarray(model.weights.lm_head))
    np.testing.assert_array_equal(np.asarray(back.d2t), np.arange(256))
    with pytest.raises(UserError, match="pass target_weights"):
        import_eagle3_hf(folder, model.config)


def test_export_refuses_what_the_format_cannot_hold(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    cfg, params = _head(model, feature_layers=(0, 1))
    with pytest.raises(UserError, match="exactly 3"):
        export_eagle3_hf(tmp_path / "two", params, cfg, model.config)
    cfg, params = _head(model)
    with pytest.raises(UserError, match="dtype"):
        export_eagle3_hf(tmp_path / "int8", params, cfg, model.config, dtype="int8")
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy/model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning, match="last layer"), pytest.raises(UserError, match="empty folder"):
        export_eagle3_hf(tmp_path / "busy", params, cfg, model.config)


def test_export_cli_and_loading_both_formats_as_drafter(tiny_llama3, tmp_path, capsys):
    """`jaxspec export` writes a bfloat16 jaxspec checkpoint (what jaxspec ships) and a Hugging Face folder; both load
    through `--drafter` (build_method), draft identically (the same bf16-rounded weights) and decode losslessly."""
    from conftest import fixture_path

    from jaxspec.checkpoint import save_drafter
    from jaxspec.cli import main
    from jaxspec.config_files import to_dict
    from jaxspec.generate import generate
    from jaxspec.methods import MethodOptions, build_method

    _, model, ref = tiny_llama3
    cfg, params = _head(model)
    source = save_drafter(tmp_path / "trained", method="eagle3", drafter_config=to_dict(cfg), params=params,
                          target_fingerprint=model.fingerprint(), target_source=model.source)
    tiny = fixture_path("tiny-llama3")
    assert main(["export", "--drafter", str(source), "--out", str(tmp_path / "bf16"), "--model", tiny]) == 0
    assert main(["export", "--drafter", str(source), "--out", str(tmp_path / "hf"), "--format", "hf",
                 "--model", tiny]) == 0
    assert "Wrote" in capsys.readouterr().out
    stored = load_file(str(tmp_path / "bf16" / "params.safetensors"))
    assert stored["fc"].dtype.name == "bfloat16" and stored["d2t"].dtype == np.float32  # ids stay exact
    prompts = [ref["input_ids"][0, :7].tolist(), ref["input_ids"][1, :19].tolist()]
    expected = generate(model.weights, model.config, prompts, max_new_tokens=16, eos_ids=()).token_ids
    results = []
    for folder in ("bf16", "hf"):
        method = build_method("eagle3", model, MethodOptions(drafter=str(tmp_path / folder), num_draft_tokens=3,
                                                             tree_width=2, tree_nodes=5))
        result = method.generate(prompts, max_new_tokens=16, eos_ids=())
        assert result.token_ids == expected
        results.append(result.accepted)
    assert results[0] == results[1]  # the same rounded head in both formats: the same drafts, the same acceptance
    assert main(["export", "--drafter", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


# ---------------------------------------------------------------------------------------------- published layouts


def _published_head(layout, folder, d=64, hq=4, hkv=2, hd=16, f=128, v=256, vd=96):
    """A random EAGLE-3 head written the way one project publishes it (field names, dtypes, config keys), made here
    from those projects' files and not by jaxspec's export:
    - "eagle": SafeAILab/EAGLE's releases (eagle/traineagle3/config.json, `Model` in eagle/traineagle3/cnets.py):
      architectures LlamaForCausalLM, no rope_theta or rope_scaling (cnets.py trains at base 10000), its
      rms_norm_eps 1e-5, no layer ids (the default taps), float16, the embedding saved with the head.
    - "specforge": SpecForge's training output (configs/qwen3-30B-A3B-eagle3.1.json, `LlamaForCausalLMEagle3` in
      specforge/modeling/draft/llama3_eagle.py): LlamaForCausalLMEagle3, its own rope_theta, target_hidden_size,
      fc_norm true with fc_norm.{0,1,2}.weight, norm_output true, bfloat16.
    - "sglang": SpecForge's SGLang export (specforge/export/to_sglang.py, `apply_legacy_rope_scaling` in
      specforge/export/checkpoint_io.py): transformers 5's rope_parameters mirrored into rope_theta and
      rope_scaling (here linear scaling), no embedding, bfloat16.
    Returns (config, float64 tensors, inverse RoPE frequencies [hd/2] the layout's trainer used)."""
    import ml_dtypes

    rng = np.random.default_rng({"eagle": 1, "specforge": 2, "sglang": 3}[layout])

    def normal(*shape, scale=0.15):
        return rng.normal(0.0, scale, shape)

    ids = np.sort(rng.choice(v, vd, replace=False))  # the draft vocabulary, by target id (EAGLE's scandata order)
    tensors = {
        "fc.weight": normal(d, 3 * d), "midlayer.input_layernorm.weight": 1 + normal(d, scale=0.3),
        "midlayer.hidden_norm.weight": 1 + normal(d, scale=0.3),
        "midlayer.self_attn.q_proj.weight": normal(hq * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": normal(hkv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": normal(hkv * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": normal(d, hq * hd),
        "midlayer.post_attention_layernorm.weight": 1 + normal(d, scale=0.3),
        "midlayer.mlp.gate_proj.weight": normal(f, d), "midlayer.mlp.up_proj.weight": normal(f, d),
        "midlayer.mlp.down_proj.weight": normal(d, f), "norm.weight": 1 + normal(d, scale=0.3),
        "lm_head.weight": normal(vd, d, scale=0.3),
    }
    config = {"hidden_act": "silu", "hidden_size": d, "intermediate_size": f, "model_type": "llama",
              "num_attention_heads": hq, "num_key_value_heads": hkv, "num_hidden_layers": 1, "vocab_size": v,
              "draft_vocab_size": vd, "tie_word_embeddings": False, "max_position_embeddings": 2048}
    exponents = np.arange(0, hd, 2) / hd  # inv_freq = theta ** -(2i / hd)
    if layout == "eagle":
        config.update(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, torch_dtype="float16", pad_token_id=0,
                      transformers_version="4.28.1", use_cache=True)
        tensors["embed_tokens.weight"] = normal(v, d)
        inv_freq, dtype = 10000.0 ** -exponents, np.float16
    elif layout == "specforge":
        config.update(architectures=["LlamaForCausalLMEagle3"], rms_norm_eps=1e-6, head_dim=hd, rope_theta=1e6,
                      rope_scaling=None, target_hidden_size=d, fc_norm=True, norm_output=True,
                      torch_dtype="bfloat16", transformers_version="4.53.2")
        tensors.update({f"fc_norm.{i}.weight": 1 + normal(d, scale=0.3) for i in range(3)})
        inv_freq, dtype = 1e6 ** -exponents, ml_dtypes.bfloat16
    else:
        rope = {"rope_theta": 20000.0, "rope_type": "linear", "factor": 2.0}
        config.update(architectures=["LlamaForCausalLMEagle3"], rms_norm_eps=1e-6, head_dim=hd,
                      rope_parameters=rope, rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                      dtype="bfloat16", transformers_version="5.0.0")
        inv_freq, dtype = 20000.0 ** -exponents / 2.0, ml_dtypes.bfloat16  # linear: positions / factor
    stored = {k: x.astype(dtype) for k, x in tensors.items()}
    stored["d2t"] = ids - np.arange(vd)  # int64 offsets
    stored["t2d"] = np.isin(np.arange(v), ids)  # bool[V]
    os.makedirs(folder)
    save_file(stored, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh)
    return config, {k: np.asarray(x, np.float64) for k, x in stored.items()}, inv_freq


@pytest.fixture(scope="module")
def deep_target(tiny_llama3):
    """The tiny Llama-3 with 8 random layers, so that the references' default taps (the stream before layers 2,
    L//2 = 4 and L-3 = 5) are real layers: jaxspec's layers (1, 3, 4)."""
    from jaxspec.model import init_weights

    _, model, ref = tiny_llama3
    cfg = dataclasses.replace(model.config, num_layers=8)
    return cfg, init_weights(cfg, jax.random.key(11), scale=0.1), ref


@pytest.mark.parametrize("layout", ["eagle", "specforge", "sglang"])
def test_published_layouts_import_and_run_as_their_trainers_ran_them(deep_target, tmp_path, layout):
    cfg_t, w, ref = deep_target
    config, tensors, inv_freq = _published_head(layout, tmp_path / layout)
    params, mcfg = import_eagle3_hf(tmp_path / layout, cfg_t)
    assert mcfg.feature_layers == (1, 3, 4)
    assert mcfg.feature_norm == (layout == "specforge") and (params.fc_norm is not None) == mcfg.feature_norm
    drafter = mcfg.make_drafter()
    head_cfg = drafter.head_config(cfg_t)
    assert head_cfg.rms_norm_eps == config["rms_norm_eps"]

    tokens = jnp.asarray([ref["input_ids"][1, :14].tolist()])
    n = 13
    out = forward(w, cfg_t, tokens[:, :n], jnp.arange(n)[None], hidden_layers=tuple(range(8)))
    stream = [np.asarray(w.embed[tokens[0, :n]], np.float64)] + [np.asarray(x[0], np.float64) for x in out.hidden]
    aux = np.concatenate([stream[k] for k in (2, 4, 5)], -1)  # the stream before layers 2, L//2, L-3
    expected = _reference_logits(tensors, {"head_dim": 16, **config}, np.asarray(w.embed[tokens[0, 1:]]), aux,
                                 inv_freq)

    hidden = jnp.stack([out.hidden[i] for i in drafter.target_layers])  # [3, 1, n, d]

    def ours(cfg):
        h, _, _ = head_forward(params, cfg, w.embed, tokens[:, 1:], fuse_features(params, hidden, cfg.rms_norm_eps),
                               jnp.arange(n)[None])
        return np.asarray(to_target_logits(params, head_logits(params, cfg, h), 256))[0]

    got = ours(head_cfg)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)
    # the power of the check: with the target's RoPE and epsilon the same weights compute something else
    assert np.abs(ours(cfg_t)[finite] - expected[finite]).max() > 1e-2

    # the drafter's own round uses the head's settings: its first tree is draft_tree's under head_cfg
    b, p = 1, 12
    prompt = tokens[:, :p]
    prefill = forward(w, cfg_t, prompt, jnp.arange(p)[None], hidden_layers=drafter.target_layers)
    sampling = SamplingConfig()
    state = drafter.init(params, cfg_t, prompt, jnp.array([p]), prefill, 32, sampling)
    history = jnp.pad(jnp.concatenate([prompt, tokens[:, p: p + 1]], 1), ((0, 0), (0, 19)))  # root at index p
    inputs = RoundInputs(target_weights=w, target_cache=init_cache(cfg_t, b, 32), history=history,
                         lengths=jnp.array([p]), root=tokens[:, p])
    tree, _, _ = drafter.propose(params, state, inputs, cfg_t, sampling, jax.random.key(0))
    by_hand = []
    for cfg in (head_cfg, cfg_t):
        feats = jnp.pad(fuse_features(params, prefill.hidden, cfg.rms_norm_eps), ((0, 0), (0, 20), (0, 0)))
        cache, h_root = absorb_pairs(params, cfg, w.embed, init_cache(cfg, b, 32, num_layers=1), feats, history,
                                     jnp.array([p]))
        by_hand.append(draft_tree(params, cfg, w.embed, cache, h_root, depth=drafter.depth, top_k=drafter.top_k,
                                  num_nodes=drafter.num_nodes)[0])
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(by_hand[0].tokens))
    np.testing.assert_array_equal(np.asarray(tree.parents), np.asarray(by_hand[0].parents))

    # lossless whatever the head's RoPE
    from jaxspec.generate import generate

    prompts = [ref["input_ids"][0, :5].tolist(), ref["input_ids"][1, :17].tolist()]
    expected_ids = generate(w, cfg_t, prompts, max_new_tokens=12, eos_ids=()).token_ids
    assert speculative_generate(w, cfg_t, drafter, params, prompts, max_new_tokens=12, eos_ids=()).token_ids == \
        expected_ids

    # export then import: the same parameters, settings and config keys a consumer reads
    if mcfg.feature_norm:
        with pytest.warns(UserWarning, match="fc_norm"):
            export_eagle3_hf(tmp_path / "again", params, mcfg, cfg_t, dtype="float32")
    else:
        export_eagle3_hf(tmp_path / "again", params, mcfg, cfg_t, dtype="float32")
    back, back_cfg = import_eagle3_hf(tmp_path / "again", cfg_t)
    _assert_params_equal(back, params)
    assert back_cfg == mcfg
    with open(tmp_path / "again/config.json") as fh:
        written = json.load(fh)
    assert written["rms_norm_eps"] == config["rms_norm_eps"] and written.get("fc_norm", False) == mcfg.feature_norm
    assert written["rope_theta"] == {"eagle": 10000.0, "specforge": 1e6, "sglang": 20000.0}[layout]
    if layout == "sglang":  # what EAGLE's own config validation accepts: exactly type and factor, a float > 1
        assert written["rope_scaling"] == {"type": "linear", "factor": 2.0}
    else:
        assert written["rope_scaling"] is None

