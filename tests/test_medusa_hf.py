"""Medusa heads in the Medusa repository's layout (jaxspec/drafters/medusa_hf.py), on the tiny Llama-3.

The fixture is written here from FasterDecoding/Medusa `medusa/model/medusa_model.py` (`MedusaModel.medusa_head`:
K x nn.Sequential(ResBlock, nn.Linear(d, V, bias=False)); `ResBlock`: x + SiLU(linear(x)), with a bias; the heads
read the base model's final-normed last hidden state) and its training scripts (`save_file(medusa_head.state_dict(),
"medusa_lm_head.safetensors")`), not by jaxspec's export."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.drafters.medusa import MedusaConfig, medusa_logits
from jaxspec.drafters.medusa_hf import export_medusa_hf, import_medusa_hf
from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.model import forward
from jaxspec.speculative import speculative_generate


def _medusa_folder(folder, d=64, v=256, heads=3, layers=1, dtype=ml_dtypes.bfloat16, shared_lm=None):
    """Random heads in Medusa's layout: config.json (MedusaConfig's keys) and medusa_lm_head.safetensors."""
    rng = np.random.default_rng(5)
    tensors = {}
    for k in range(heads):
        for j in range(layers):
            tensors[f"{k}.{j}.linear.weight"] = rng.normal(0, 0.2, (d, d))  # nn.Linear(d, d).weight [out, in]
            tensors[f"{k}.{j}.linear.bias"] = rng.normal(0, 0.2, d)
        tensors[f"{k}.{layers}.weight"] = rng.normal(0, 0.3, (v, d)) if shared_lm is None else shared_lm
    os.makedirs(folder)
    save_file({n: np.asarray(x).astype(dtype) for n, x in tensors.items()}, os.path.join(folder,
                                                                                        "medusa_lm_head.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": heads, "medusa_num_layers": layers,
                   "base_model_name_or_path": "tiny-llama3", "transformers_version": "4.34.0"}, f)
    return {n: np.asarray(np.asarray(x).astype(dtype), np.float64) for n, x in tensors.items()}


def _reference(tensors, x, heads):
    """Medusa's forward in float64 numpy: x [T, d] the base model's final-normed hidden states -> [T, K, V]."""
    out = []
    for k in range(heads):
        z = x @ tensors[f"{k}.0.linear.weight"].T + tensors[f"{k}.0.linear.bias"]
        h = x + z / (1 + np.exp(-z))  # ResBlock: x + SiLU(linear(x))
        out.append(h @ tensors[f"{k}.1.weight"].T)
    return np.stack(out, 1)


def test_medusa_layout_imports_and_computes_what_medusa_does(tiny_llama3, tmp_path):
    _, model, ref = tiny_llama3
    cfg, w = model.config, model.weights
    tensors = _medusa_folder(tmp_path / "heads")
    params, mcfg = import_medusa_hf(tmp_path / "heads", cfg, w)
    assert mcfg.num_heads == 3 and mcfg.own_lm_head and params.lm_head.shape == (3, 64, 256)

    tokens = jnp.asarray([ref["input_ids"][0, :10].tolist()])
    out = forward(w, cfg, tokens, jnp.arange(10)[None])
    last = out.last_hidden[0]  # [T, d] before the final norm
    x = np.asarray(last, np.float64)
    normed = np.asarray(w.final_norm, np.float64) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
    expected = _reference(tensors, normed, 3)
    got = np.asarray(medusa_logits(params, w, cfg, last))  # [T, K, V]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

    # lossless through the decoding loop, with the default tree cut to these heads
    prompts = [ref["input_ids"][0, :6].tolist(), ref["input_ids"][1, :15].tolist()]
    want = generate(w, cfg, prompts, max_new_tokens=12, eos_ids=()).token_ids
    assert speculative_generate(w, cfg, mcfg.make_drafter(), params, prompts, max_new_tokens=12,
                                eos_ids=()).token_ids == want

    # --drafter takes the folder (build_method reads the layout)
    from jaxspec.methods import MethodOptions, build_method

    method = build_method("medusa", model, MethodOptions(drafter=str(tmp_path / "heads")))
    assert method.drafter == mcfg.make_drafter()
    for a, b in zip(jax.tree.leaves(method.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # export then import: the same tensors and parameters
    export_medusa_hf(tmp_path / "again", params, w, dtype="float32", base_model="tiny-llama3")
    back, back_cfg = import_medusa_hf(tmp_path / "again", cfg, w)
    assert back_cfg == mcfg
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    written = load_file(tmp_path / "again/medusa_lm_head.safetensors")
    assert sorted(written) == sorted(tensors)


def test_heads_sharing_the_target_s_lm_head(tiny_llama3, tmp_path):
    """jaxspec's default Medusa heads share the target's LM head: export writes it into every head, import shares
    it again (and a file whose heads equal the target's to its precision is read the same way)."""
    _, model, _ = tiny_llama3
    cfg, w = model.config, model.weights
    params = MedusaConfig(num_heads=2, choices=((0,), (1,), (0, 0))).init_params(cfg, w)
    params = jax.tree.map(lambda a: a + 0.01, params)
    assert params.lm_head is None
    export_medusa_hf(tmp_path / "shared", params, w, dtype="float32")
    lm = np.asarray(w.embed.T if w.lm_head is None else w.lm_head)  # [d, V]
    np.testing.assert_array_equal(load_file(tmp_path / "shared/medusa_lm_head.safetensors")["1.1.weight"], lm.T)
    back, back_cfg = import_medusa_hf(tmp_path / "shared", cfg, w)
    assert back.lm_head is None and not back_cfg.own_lm_head
    np.testing.assert_array_equal(np.asarray(back.w), np.asarray(params.w))


REFUSALS = {
    "two residual blocks": (dict(layers=2), "2 residual blocks per head"),
    "another vocabulary": (dict(v=300), "predicts over 300 tokens but the target has 256"),
    "another width": (dict(d=32), "does not fit this target \\(width 64\\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(tiny_llama3, tmp_path, case):
    _, model, _ = tiny_llama3
    kwargs, message = REFUSALS[case]
    _medusa_folder(tmp_path / "heads", **kwargs)
    with pytest.raises(UserError, match=message):
        import_medusa_hf(tmp_path / "heads", model.config)


def test_torch_pickle_is_refused_with_the_conversion(tiny_llama3, tmp_path):
    _, model, _ = tiny_llama3
    os.makedirs(tmp_path / "pt")
    (tmp_path / "pt/config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    (tmp_path / "pt/medusa_lm_head.pt").write_bytes(b"")
    with pytest.raises(UserError, match="reads only safetensors"):
        import_medusa_hf(tmp_path / "pt", model.config)
