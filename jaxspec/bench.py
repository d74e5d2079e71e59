"""`jaxspec bench`: every method against autoregressive decoding of the same target, on the evaluation prompt sets.

    jaxspec bench                                          # SmolLM2-135M; AR, prompt lookup, early exit; 3 sets
    jaxspec bench --methods prompt-lookup --num-draft-tokens 2,4,8 --prompt-sets gsm8k --limit 16
    jaxspec bench --temperatures 0,1 --batch-sizes 1,4 --out bench_out/ --no-peers
    jaxspec bench --mesh data=4,model=1 --batch-sizes 4,8 --prompt-sets mt-bench --no-peers

For each prompt set x temperature x batch size, every method (autoregressive always first, as the baseline)
decodes all prompts of the set in batches of that size, with the model's EOS. Reported per run: tokens/s (all new
tokens / all seconds), the wall-clock speedup over autoregressive measured in the same run on the same prompts,
tau (mean tokens per verification round, bonus included), the acceptance rate at each draft position, and at
T=0 whether the tokens equal autoregressive's token for token (greedy speculative decoding must be identical).

Compilation is excluded: the first call of a method on each compiled shape (prompt-width bucket, batch rows,
cache size, sampling settings) is an untimed warm-up run; its seconds are reported apart as `warmup_seconds`.

Outputs (in --out, default `bench_out/`): `results.json`, `accepted_length.png` (distribution of drafted tokens
accepted per round, per method) and, when --num-draft-tokens sweeps K, `speedup_vs_k.png`. With torch and
transformers importable (and no --no-peers), transformers' `generate` and its prompt lookup run on the same prompts
at batch 1, T=0, as the peers "hf-generate" and "hf-prompt-lookup"; with `llama_cpp` importable (pip install
llama-cpp-python) and a GGUF target, llama.cpp decodes the same weights in float32 as the peer "llama-cpp".

The core, `run_bench`, takes token ids, so it runs on any target (the tests use tiny random models).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from tqdm import tqdm

from jaxspec import metrics
from jaxspec.errors import UserError
from jaxspec.generate import pad_prompts
from jaxspec.loading import LoadedModel
from jaxspec.methods import Method, build_method
from jaxspec.profiling import round_phase_ms
from jaxspec.sampling import SamplingConfig

__all__ = ["add_bench_parser", "cmd_bench", "format_table", "run_bench", "write_outputs"]

DEFAULT_METHODS = "autoregressive,prompt-lookup,early-exit"
DEFAULT_PROMPT_SETS = "mt-bench,gsm8k,humaneval"
BASELINE = "autoregressive"
PEER_THREADS = 2
WARMUP_NOTE = (
    "Compile time is excluded: the first call of each method on each compiled shape (prompt-width bucket, batch "
    "rows, cache size, sampling settings) is an untimed warm-up run, reported apart as warmup_seconds. seconds and "
    "tokens_per_second cover the timed runs only (prefill included). Peers (transformers) get one untimed warm-up "
    "generation each."
)


# ---------------------------------------------------------------------------------------------- parsing


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got '{text}'") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _budget_list(text: str) -> list:
    """--budget in the bench: a comma list of positive integers and 'auto', e.g. 8,16,32,64,auto."""
    values = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        if x != "auto" and not (x.isdigit() and int(x) > 0):
            raise argparse.ArgumentTypeError(f"expected positive integers or 'auto' separated by commas, got '{text}'")
        values.append(x if x == "auto" else int(x))
    if not values:
        raise argparse.ArgumentTypeError("expected at least one budget")
    return values


def _name_list(text: str) -> list[str]:
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))  # unique, in order


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `bench` command to the `jaxspec` CLI.

    Args:
        subparsers: The object returned by `ArgumentParser.add_subparsers`.

    Returns:
        The `bench` parser.
    """
    from jaxspec.arguments import add_layers_arg, add_method_args, add_model_args

    # "resolve": --num-draft-tokens below replaces the single-integer option of add_method_args with a list.
    p = subparsers.add_parser("bench", help="benchmark methods against autoregressive decoding on prompt sets",
                              description=__doc__.split("\n\n")[0], conflict_handler="resolve")
    add_model_args(p)
    p.add_argument("--methods", type=_name_list, default=_name_list(DEFAULT_METHODS),
                   help=f"comma list (default {DEFAULT_METHODS}); autoregressive always runs as the baseline; a "
                        "learned method may name its drafter: medusa=runs/medusa-smollm2-135m/drafter,medusa=untrained")
    p.add_argument("--prompt-sets", type=_name_list, default=_name_list(DEFAULT_PROMPT_SETS),
                   help=f"comma list of mt-bench, gsm8k, humaneval (default {DEFAULT_PROMPT_SETS})")
    p.add_argument("--limit", type=int, default=8, help="prompts per set (the first N; default 8)")
    p.add_argument("--temperatures", type=_float_list, default=[0.0], help="comma list (default 0 = greedy)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1], help="comma list (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    add_method_args(p)
    p.add_argument("--num-draft-tokens", type=_int_list, default=None,
                   help="drafted tokens per round; a comma list sweeps K, e.g. 2,4,8 (default per method: "
                        "draft-model 4, prompt-lookup 4, early-exit 3)")
    p.add_argument("--budget", type=_budget_list, default=None,
                   help="tree budgets to sweep, e.g. 8,16,32,64,auto: ddtree/jetspec nodes per round (auto: chosen per "
                        "batch size from the device's cost model), dflash chain length (<= block size), eagle2/eagle3 "
                        "tree nodes N")
    p.add_argument("--out", default="bench_out", help="folder for results.json and the plots (default bench_out/)")
    p.add_argument("--no-peers", action="store_true",
                   help="skip the peers: transformers' generate and prompt lookup, llama.cpp")
    p.add_argument("--phases", action="store_true",
                   help="also time each speculative round's phases (draft, verify, accept, commit) in ms, from one "
                        "profiled run of each row's first batch (jaxspec.profiling; one more compilation per row; "
                        "the run compiles without the persistent compilation cache, whose entries may carry "
                        "another version's op names)")
    add_layers_arg(p)
    return p


# ---------------------------------------------------------------------------------------------- the runs


def method_k(method: Method, batch_size: int = 1, greedy: bool = True) -> int | None:
    """Draft depth K per round at this batch size (accepted tokens per round are at most K; --budget auto may choose
    it per batch size and for greedy or sampled decoding); None for autoregressive."""
    if method.drafter is None or method.is_pipeline:
        return None
    drafter = method.drafter_for_batch(batch_size, greedy)
    if drafter is None:  # --budget auto chose no draft (plain decoding)
        return 0
    depth, nodes = getattr(drafter, "depth", None), getattr(drafter, "num_nodes", None)
    lookup = getattr(drafter, "lookup_depth", 0)  # EAGLE with a prompt-lookup chain: its nodes reach depth `lookup`
    if depth and nodes:  # a tree of fewer nodes than its depth (a pruned dynamic tree) accepts at most its nodes
        return int(max(min(depth, nodes - lookup), lookup))
    return int(depth or nodes)


def method_nodes(method: Method, batch_size: int = 1, greedy: bool = True) -> int | None:
    """Drafted nodes verified per round (the tree budget) at this batch size; None for autoregressive."""
    if method.drafter is None or method.is_pipeline:
        return None
    drafter = method.drafter_for_batch(batch_size, greedy)
    return 0 if drafter is None else int(drafter.num_nodes)  # 0: --budget auto chose no draft


def method_width(method: Method) -> int:
    """Siblings per draft depth (tree drafters); 1 for chains and autoregressive."""
    return int(getattr(method.drafter, "tree_width", 1) or 1)


def method_label(name: str, k: int | None, width: int = 1) -> str:
    """'prompt-lookup K=4' ('early-exit K=3 W=2' for trees), or the bare name for methods without K."""
    return name if k is None else f"{name} K={k}" + (f" W={width}" if width > 1 else "")


def mesh_label(mesh) -> str:
    """The shape of a method's device mesh for the results: "4x2" (data x model), "stage=5" for a pipeline's stage
    mesh, "1 device" without one."""
    if mesh is None:
        return "1 device"
    sizes = dict(mesh.shape)
    if tuple(sizes) == ("data", "model"):
        return f"{sizes['data']}x{sizes['model']}"
    return ",".join(f"{name}={size}" for name, size in sizes.items())


def _label(method: Method, batch_size: int = 1, greedy: bool = True) -> str:
    """The method label, with N=nodes when a tree's node count is not K x W (EAGLE-2/3) or is a budget (DFlash,
    DDTree, JetSpec)."""
    label = method_label(method.name, method_k(method, batch_size, greedy), method_width(method))
    if method_k(method, batch_size, greedy) == 0:
        return f"{label} (no draft)"  # --budget auto chose plain decoding at this batch size
    if method.is_pipeline:
        width = method.drafter.tree_width
        return f"{label} n={method.drafter.num_stages}" + (f" W={width}" if width > 1 else "")
    nodes = method_nodes(method, batch_size, greedy)
    budgeted = hasattr(method.drafter, "budget")  # DFlash / DDTree / JetSpec: always name the budget
    if nodes is not None and (budgeted or nodes != method_k(method, batch_size, greedy) * method_width(method)):
        label += f" N={nodes}"
    lookup = getattr(method.drafter_for_batch(batch_size, greedy), "lookup_depth", 0)
    if lookup:  # EAGLE with a prompt-lookup chain merged in: N counts its nodes too
        label += f" L={lookup}"
    return label


def _batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[list[int]]]:
    return [list(prompts[i: i + batch_size]) for i in range(0, len(prompts), batch_size)]


def _shape_key(method: Method, rows, max_new_tokens: int, sampling: SamplingConfig) -> tuple:
    """What decides a compilation of the method's jitted loop: the padded prompt shape, cache size, sampling."""
    drafter = method.drafter_for_batch(len(rows), sampling.temperature == 0)
    if drafter is None:
        extra = 0
    elif method.is_pipeline:  # in-flight tokens beyond the committed ones
        extra = drafter.num_stages + 1
    else:
        extra = drafter.num_nodes + 1  # a round may overshoot by T + 1 slots
    batch = pad_prompts(rows, max_new_tokens, method.target.config, draft_slots=extra)
    return _label(method, len(rows), sampling.temperature == 0), batch.tokens.shape, batch.cache_size, sampling


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter list), None when equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _run_method(method: Method, batches, *, max_new_tokens: int, sampling: SamplingConfig, seed: int,
                eos_ids, compiled: set) -> dict:
    """Decodes every batch once (after a warm-up on each new compiled shape); returns tokens, time, rounds."""
    token_ids: list[list[int]] = []
    accepted: list[list[int]] = []  # per prompt: drafted tokens accepted in each round
    seconds = warmup = 0.0
    pipeline = dict.fromkeys(("steps", "bubbles", "exits", "rejections", "promotions"), 0)  # ppsd / spd counters
    for index, rows in enumerate(batches):
        options = {"max_new_tokens": max_new_tokens, "sampling": sampling, "seed": seed + index, "eos_ids": eos_ids}
        key = _shape_key(method, rows, max_new_tokens, sampling)
        if key not in compiled:  # compile (and run once) untimed
            start = time.perf_counter()
            method.generate(rows, **options)
            warmup += time.perf_counter() - start
            compiled.add(key)
        result = method.generate(rows, **options)
        seconds += result.seconds
        token_ids += result.token_ids
        if method.is_pipeline:
            for name in pipeline:
                pipeline[name] += getattr(result, name)
        elif method.drafter is not None:
            accepted += result.accepted
    return {"token_ids": token_ids, "accepted": accepted, "seconds": seconds, "warmup_seconds": warmup,
            "pipeline": pipeline}


def _finite(x: float | None) -> float | None:
    """x as a float, or None for None and NaN (JSON has no NaN)."""
    return None if x is None or math.isnan(x) else float(x)


def _summarize(method: Method, run: dict, baseline: dict | None, *, prompt_set: str, temperature: float,
               batch_size: int, num_batches: int) -> dict:
    greedy = temperature == 0
    k = method_k(method, batch_size, greedy)
    new_tokens = sum(len(t) for t in run["token_ids"])
    tps = new_tokens / run["seconds"] if run["seconds"] > 0 else float("nan")
    row: dict[str, Any] = {
        "method": method.name,
        "num_draft_tokens": k,
        "tree_width": None if k is None else method_width(method),
        "tree_nodes": method_nodes(method, batch_size, greedy),
        "budget_auto": method.cost_model is not None,
        # --budget auto: the throughput model behind the choice at this batch size
        "auto_budget_table": method.auto_table(batch_size, greedy)[2] if method.cost_model is not None else None,
        "label": _label(method, batch_size, greedy),
        "mesh": mesh_label(method.mesh),  # "4x2" (data x model), "1 device"
        "mesh_shape": None if method.mesh is None else dict(method.mesh.shape),
        "prompt_set": prompt_set,
        "temperature": temperature,
        "batch_size": batch_size,
        "num_prompts": len(run["token_ids"]),
        "num_batches": num_batches,
        "new_tokens": new_tokens,
        "seconds": run["seconds"],
        "warmup_seconds": run["warmup_seconds"],
        "tokens_per_second": _finite(tps),
        "speedup": 1.0 if baseline is None else _finite(tps / baseline["tokens_per_second"]),
        "tau": None,
        "theoretical_speedup": None,
        "rounds": None,
        "acceptance_by_position": None,
        "accepted_length_histogram": None,
        "matches_autoregressive": None,
        "mismatched_prompts": [],
        "token_ids": run["token_ids"],  # kept in memory for comparisons; not written to results.json
    }
    if k is not None:
        cfg = method.target.config
        row.update(
            tau=_finite(metrics.tau(run["accepted"])),
            # tau * L / (Ls * m + L), METHODS.md: drafting cost in target-layer equivalents
            theoretical_speedup=_finite(metrics.theoretical_speedup(
                metrics.tau(run["accepted"]), cfg.num_layers, _draft_layers(method, batch_size, greedy))),
            rounds=sum(len(a) for a in run["accepted"]),
            acceptance_by_position=[_finite(x) for x in metrics.acceptance_by_position(run["accepted"], k)],
            # [K + 1]: rounds that accepted 0, 1, ..., K drafted tokens
            accepted_length_histogram=metrics.accepted_length_histogram(run["accepted"], k),
        )
    if method.is_pipeline:
        cfg, drafter, counts = method.target.config, method.drafter, run["pipeline"]
        alpha = counts["exits"] / counts["steps"] if counts["steps"] else float("nan")
        l_acc = alpha * drafter.num_stages
        ls = drafter.draft_cost_layers(cfg)
        row.update(
            num_stages=drafter.num_stages, pipeline_steps=counts["steps"], bubbles=counts["bubbles"],
            rejections=counts["rejections"], sibling_promotions=counts["promotions"], alpha=_finite(alpha),
            # METHODS.md: SPD's input-state drafter is hidden, L'acc = alpha * n; a drafter that waits for the step
            # (PPSD, SPD output state) costs Ls layers per step: L'acc * L / (Ls * n + L)
            tau=_finite(l_acc), equivalent_acceptance=_finite(l_acc),
            theoretical_speedup=_finite(l_acc if drafter.hides_drafting else metrics.ppsd_speedup(
                l_acc, cfg.num_layers, ls, drafter.num_stages)),
        )
    if temperature == 0.0:
        reference = run["token_ids"] if baseline is None else baseline["token_ids"]
        mismatches = [
            {"prompt": i, "first_mismatch": m, "tokens": len(a), "autoregressive_tokens": len(b)}
            for i, (a, b) in enumerate(zip(run["token_ids"], reference))
            if (m := _first_mismatch(a, b)) is not None
        ]
        row.update(matches_autoregressive=not mismatches, mismatched_prompts=mismatches)
    return row


def _draft_layers(method: Method, batch_size: int, greedy: bool) -> float:
    """The drafting work of one round in target layers (Ls * m, METHODS.md) of the drafter that runs at this batch
    size (--budget auto's choice); 0 where that is no draft."""
    drafter = method.drafter_for_batch(batch_size, greedy)
    return 0.0 if drafter is None else float(drafter.draft_cost_layers(method.target.config))


def _greedy_warning(row: dict) -> str:
    bad = row["mismatched_prompts"]
    first = bad[0]
    return (f"WARNING: GREEDY MISMATCH: {row['label']} on {row['prompt_set']} (T=0, batch {row['batch_size']}) "
            f"differs from autoregressive in {len(bad)} of {row['num_prompts']} prompts (first: prompt "
            f"{first['prompt']} at token {first['first_mismatch']}). Greedy speculative decoding must be identical.")


def _baseline_like(target: LoadedModel, methods: Sequence[Method]) -> Method:
    """Autoregressive decoding on the same (data, model) mesh as the given methods (one device when they have none)."""
    on_mesh = next((m for m in methods if m.mesh is not None and "data" in m.mesh.axis_names), None)
    if on_mesh is None:
        return build_method(BASELINE, target)
    return Method(name=BASELINE, drafter=None, params=None, target=on_mesh.target, mesh=on_mesh.mesh)


def run_bench(
    target: LoadedModel,
    methods: Sequence[Method],
    prompt_sets: Mapping[str, Sequence[Sequence[int]]],
    *,
    temperatures: Sequence[float] = (0.0,),
    batch_sizes: Sequence[int] = (1,),
    max_new_tokens: int = 128,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    peers: bool = False,
    peer_prompt_lookup_ks: Sequence[int] = (4,),
    ngram: int = 3,
    progress: bool = True,
    phases: bool = False,
) -> dict:
    """Times every method against autoregressive decoding on every prompt set x temperature x batch size.

    Args:
        target: The target model (its `source` is what the peers load).
        methods: Built methods (`jaxspec.methods.build_method`); an autoregressive one is added first when absent.
            The same method name may appear with several K (a sweep).
        prompt_sets: Set name -> token-id prompts (any lengths).
        temperatures: Sampling temperatures (0 = greedy; only T=0 checks token equality).
        batch_sizes: Rows decoded together; the last batch of a set may be smaller.
        max_new_tokens: New tokens per prompt at most.
        seed: Seed of the first batch; batch i uses seed + i (the same for every method).
        eos_ids: Stop tokens (None: the target's EOS).
        peers: Also time transformers' generate and prompt lookup (batch 1, T=0) when torch imports, and
            llama.cpp's greedy decoding of the same weights in float32 when `llama_cpp` imports (a GGUF target).
        peer_prompt_lookup_ks: `prompt_lookup_num_tokens` values for the "hf-prompt-lookup" peer.
        ngram: `max_matching_ngram_size` of the transformers prompt lookup (jaxspec's --ngram).
        progress: Show a tqdm progress bar over the runs.
        phases: Add "round_ms" to each row of the speculative loop: its round's time by phase
            (`jaxspec.profiling.round_phase_ms` on the row's first batch).

    Returns:
        A dict with "results" (one row per method, prompt set, temperature and batch size, then the peers' rows),
        "greedy_identical" (every T=0 jaxspec row equals autoregressive), "greedy_mismatches" (warnings),
        "peers" and "llama_cpp" (what ran or why not), and "note" (compilation is excluded). Rows hold "token_ids" in
        memory; `write_outputs` leaves them out of results.json.
    """
    methods = list(methods)
    baselines = [m for m in methods if m.drafter is None]
    others = [m for m in methods if m.drafter is not None]
    methods = [baselines[0] if baselines else _baseline_like(target, others), *others]
    if not prompt_sets or any(len(p) == 0 for p in prompt_sets.values()):
        raise UserError("Every prompt set needs at least one prompt.")

    results: list[dict] = []
    warnings: list[str] = []
    compiled: set = set()
    baselines: dict[tuple, dict] = {}  # (set, T, batch) -> the autoregressive row
    total = len(prompt_sets) * len(temperatures) * len(batch_sizes) * len(methods)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr) as bar:
        # method by method (autoregressive first), releasing each method's compiled programs when it is done: a
        # sweep compiles hundreds of programs, and keeping them all exhausts the process's memory mappings (LLVM
        # "Cannot allocate memory" on XLA:CPU)
        for method in methods:
            for set_name, prompts in prompt_sets.items():
                for temperature in temperatures:
                    sampling = SamplingConfig(temperature=float(temperature))
                    for batch_size in batch_sizes:
                        batches = _batches(prompts, batch_size)
                        key = (set_name, float(temperature), batch_size)
                        bar.set_postfix_str(f"{_label(method, 1, temperature == 0)} | {set_name} T={temperature:g} "
                                            f"B={batch_size}")
                        run = _run_method(method, batches, max_new_tokens=max_new_tokens, sampling=sampling,
                                          seed=seed, eos_ids=eos_ids, compiled=compiled)
                        row = _summarize(method, run, baselines.get(key), prompt_set=set_name,
                                         temperature=float(temperature), batch_size=batch_size,
                                         num_batches=len(batches))
                        if (phases and method.drafter is not None and not method.is_pipeline
                                and method.drafter_for_batch(batch_size, temperature == 0) is not None):
                            row["round_ms"] = round_phase_ms(method, batches[0], max_new_tokens=max_new_tokens,
                                                             sampling=sampling, seed=seed, eos_ids=eos_ids)
                        baselines.setdefault(key, row)
                        if row["matches_autoregressive"] is False:
                            warnings.append(_greedy_warning(row))
                            tqdm.write(warnings[-1], file=sys.stderr)
                        results.append(row)
                        bar.update()
            jax.clear_caches()
    results = _ordered(results)  # back to (set, T, batch) groups, autoregressive first in each, methods in order

    out = {
        "note": WARMUP_NOTE,
        "max_new_tokens": max_new_tokens,
        "temperatures": [float(t) for t in temperatures],
        "batch_sizes": list(batch_sizes),
        "seed": seed,
        "eos_ids": list(target.config.eos_token_ids if eos_ids is None else eos_ids),
        "prompt_sets": {name: {"num_prompts": len(p), "prompt_tokens_min": min(map(len, p)),
                               "prompt_tokens_max": max(map(len, p))} for name, p in prompt_sets.items()},
        "methods": list(dict.fromkeys(_label(m) for m in methods)),
        "results": results,
        "greedy_identical": not warnings,
        "greedy_mismatches": warnings,
    }
    if not peers:
        out["peers"] = out["llama_cpp"] = {"skipped": "not requested (--no-peers)"}
        return out
    llama_rows, out["llama_cpp"] = _run_llama_cpp_peer(target, prompt_sets, max_new_tokens, out["eos_ids"], progress)
    _attach_peer_speedups(llama_rows, results)
    results.extend(llama_rows)
    try:
        peers_script = _load_peers_script()
    except ImportError as e:
        out["peers"] = {"skipped": f"torch/transformers not importable ({e}); pip install torch==2.13.0 accelerate"}
        return out
    if peers_script is None:
        out["peers"] = {"skipped": f"{PEERS_SCRIPT} not found (it comes with a source checkout)"}
        return out
    peer_rows, info = peers_script.run_peers(target, prompt_sets, max_new_tokens=max_new_tokens,
                                             eos_ids=out["eos_ids"], prompt_lookup_ks=peer_prompt_lookup_ks,
                                             ngram=ngram, progress=progress)
    _attach_peer_speedups(peer_rows, results)
    out["peers"] = info
    results.extend(peer_rows)
    return out


# ---------------------------------------------------------------------------------------------- peers

PEERS_SCRIPT = "benchmarks/peers.py"  # transformers' generate timed beside jaxspec (torch is imported there only)
LLAMA_CPP_SCRIPT = "benchmarks/peer_llama_cpp.py"  # llama.cpp's float32 decoding of the same GGUF


def _load_peers_script():
    """The peers script of a source checkout as a module, or None when absent; ImportError without torch."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PEERS_SCRIPT)
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("jaxspec_bench_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_llama_cpp_peer(target, prompt_sets, max_new_tokens: int, eos_ids, progress: bool) -> tuple[list[dict], dict]:
    """llama.cpp's rows (benchmarks/peer_llama_cpp.py) and what ran, or no rows and why not."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return [], {"skipped": "llama_cpp not importable (pip install llama-cpp-python: it builds llama.cpp)"}
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), LLAMA_CPP_SCRIPT)
    if not os.path.isfile(path):
        return [], {"skipped": f"{LLAMA_CPP_SCRIPT} not found (it comes with a source checkout)"}
    if not str(target.source).endswith(".gguf"):
        return [], {"skipped": f"the target {target.source} is not a GGUF file"}
    spec = importlib.util.spec_from_file_location("jaxspec_bench_llama_cpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_llama_cpp(target, prompt_sets, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                progress=progress)


def _attach_peer_speedups(peer_rows: list[dict], results: list[dict]) -> None:
    """Speedup and token equality of each peer row against jaxspec autoregressive (same set, T=0, batch 1)."""
    for row in peer_rows:
        base = next((r for r in results if r["method"] == BASELINE and r["prompt_set"] == row["prompt_set"]
                     and r["temperature"] == 0.0 and r["batch_size"] == 1), None)
        if base is None:
            continue
        if base["tokens_per_second"] and row["tokens_per_second"] is not None:
            row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
        mismatches = [{"prompt": i, "first_mismatch": m, "tokens": len(a), "autoregressive_tokens": len(b)}
                      for i, (a, b) in enumerate(zip(row["token_ids"], base["token_ids"]))
                      if (m := _first_mismatch(a, b)) is not None]
        row.update(matches_autoregressive=not mismatches, mismatched_prompts=mismatches)


# ---------------------------------------------------------------------------------------------- report


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _acceptance(values: Sequence[float | None] | None, shown: int = 4) -> str:
    if not values:
        return "-"
    text = " ".join(_fmt(v) for v in values[:shown])
    return text + (" ..." if len(values) > shown else "")


def _round_ms(phases: dict | None) -> str:
    """"12.3 = 2.1+8.9+0.4+0.6+0.3" from a row's round_ms (jaxspec.profiling.round_phase_ms)."""
    if not phases:
        return "-"
    parts = "+".join(f"{phases[p]:.1f}" for p in ("draft", "verify", "accept", "commit", "loop"))
    return f"{phases['round']:.1f} = {parts}"


def _ordered(results: Sequence[dict]) -> list[dict]:
    """Rows in run order, each (set, T, batch) group's jaxspec rows followed by its peer rows."""
    def group(r):
        return r["prompt_set"], r["temperature"], r["batch_size"]

    order = {g: i for i, g in enumerate(dict.fromkeys(group(r) for r in results))}
    return sorted(results, key=lambda r: (order[group(r)], bool(r.get("peer"))))  # stable: run order kept


def format_table(bench: dict) -> str:
    """The results as a plain-text table (one line per method, prompt set, temperature and batch size)."""
    header = ["method", "K", "set", "T", "batch", "mesh", "prompts", "tokens", "tok/s", "speedup", "tau", "theory",
              "accept@1..4", "=AR"]
    phases = any(r.get("round_ms") for r in bench["results"])
    if phases:
        header.append("round ms = draft+verify+accept+commit+loop")
    lines = []
    for r in _ordered(bench["results"]):
        equal = r["matches_autoregressive"]
        if equal is None:
            equal_text = "-"
        elif r.get("peer"):
            equal_text = "yes" if equal else "no"
        else:
            equal_text = "yes" if equal else "NO!"
        width = r.get("tree_width") or 1
        theory = r.get("theoretical_speedup")
        k_text = _fmt(r["num_draft_tokens"], "d") + (f"x{width}" if width > 1 else "")
        lines.append([r["method"], k_text, r["prompt_set"], f"{r['temperature']:g}",
                      str(r["batch_size"]), r.get("mesh") or "-", str(r["num_prompts"]), str(r["new_tokens"]),
                      _fmt(r["tokens_per_second"], ".1f"), _fmt(r["speedup"]) + ("x" if r["speedup"] else ""),
                      _fmt(r["tau"]), _fmt(theory) + ("x" if theory else ""),
                      _acceptance(r["acceptance_by_position"]), equal_text])
        if phases:
            lines[-1].append(_round_ms(r.get("round_ms")))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    left = {0, 2, 5, 12, 14}

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)])


def _plot_accepted_lengths(bench: dict, path: str) -> bool:
    """Bars of the fraction of rounds that accepted j drafted tokens, per method, one panel per temperature."""
    import matplotlib.ticker
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    rows = [r for r in bench["results"] if r["accepted_length_histogram"] is not None]
    if not rows:
        return False
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    fig = Figure(figsize=(6 * len(temperatures), 4))
    axes = fig.subplots(1, len(temperatures), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        counts: dict[str, np.ndarray] = {}  # label -> int[K + 1], summed over sets and batch sizes
        for r in rows:
            if r["temperature"] == temperature:
                hist = np.asarray(r["accepted_length_histogram"])  # [K + 1]
                counts[r["label"]] = counts.get(r["label"], np.zeros_like(hist)) + hist
        width = 0.8 / len(counts)
        for i, (label, hist) in enumerate(counts.items()):
            fraction = hist / max(hist.sum(), 1)  # [K + 1]
            ax.bar(np.arange(len(hist)) + (i - (len(counts) - 1) / 2) * width, fraction, width=width, label=label)
        ax.set_xlabel("drafted tokens accepted in a round (tokens per round = this + 1)")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"Accepted length per round, T={temperature:g} (all prompt sets)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _plot_speedup_vs_k(bench: dict, path: str) -> bool:
    """Speedup over autoregressive against K, one line per method x prompt set x batch size, one panel per T."""
    import matplotlib.ticker
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    rows = [r for r in bench["results"] if r["num_draft_tokens"] is not None and not r.get("peer")]
    def family(r):  # one line per method and tree width
        return r["method"] + (f" W={r['tree_width']}" if (r.get("tree_width") or 1) > 1 else "")

    ks: dict[str, set] = {}
    for r in rows:
        ks.setdefault(family(r), set()).add(r["num_draft_tokens"])
    rows = [r for r in rows if len(ks[family(r)]) > 1 and r["speedup"] is not None]
    if not rows:
        return False
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    multi_batch = len({r["batch_size"] for r in rows}) > 1
    fig = Figure(figsize=(6 * len(temperatures), 4))
    axes = fig.subplots(1, len(temperatures), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["temperature"] == temperature:
                name = f"{family(r)} / {r['prompt_set']}" + (f" / B={r['batch_size']}" if multi_batch else "")
                lines.setdefault(name, []).append((r["num_draft_tokens"], r["speedup"]))
        for name, points in lines.items():
            points.sort()
            ax.plot([k for k, _ in points], [s for _, s in points], marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="autoregressive")
        ax.set_xlabel("drafted tokens per round K")
        ax.set_ylabel("speedup over autoregressive (tokens/s)")
        ax.set_title(f"Speedup vs K, T={temperature:g}")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_outputs(bench: dict, out_dir: str) -> dict[str, str]:
    """Writes results.json and the PNG plots into `out_dir` (created if needed).

    Args:
        bench: What `run_bench` returned (plus any extra keys to record, e.g. the command).
        out_dir: The output folder.

    Returns:
        Output kind ("json", "accepted_length", "speedup_vs_k") -> path, for the files written.
    """
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    plots = {"accepted_length": _plot_accepted_lengths, "speedup_vs_k": _plot_speedup_vs_k}
    for kind, plot in plots.items():
        path = os.path.join(out_dir, f"{kind}.png")
        if plot(bench, path):
            written[kind] = path
    record = dict(bench, plots=sorted(os.path.basename(p) for p in written.values()))
    record["results"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in bench["results"]]
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    written["json"] = path
    return written


# ---------------------------------------------------------------------------------------------- the command


def _check_args(args) -> None:
    from jaxspec.methods import LEARNED_METHODS, METHODS
    from jaxspec.prompts import PROMPT_SETS

    for spec in args.methods:
        name, has_drafter, _ = spec.partition("=")
        if name not in METHODS:
            raise UserError(f"Unknown method '{name}' in --methods; choose from {', '.join(METHODS)}.")
        if has_drafter and name not in LEARNED_METHODS:
            raise UserError(f"'{spec}': only learned methods ({', '.join(LEARNED_METHODS)}) take a drafter.")
    _check_flags_apply(args)
    for name in args.prompt_sets:
        if name not in PROMPT_SETS:
            raise UserError(f"Unknown prompt set '{name}' in --prompt-sets; choose from {', '.join(PROMPT_SETS)}.")
    if not args.prompt_sets:
        raise UserError("--prompt-sets names no set; give e.g. mt-bench,gsm8k,humaneval.")
    if args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}.")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
    if min(args.batch_sizes) < 1:
        raise UserError(f"--batch-sizes must be at least 1, got {args.batch_sizes}.")
    if min(args.temperatures) < 0:
        raise UserError(f"--temperatures must be >= 0 (0 = greedy), got {args.temperatures}.")
    from jaxspec.arguments import check_mesh_arg

    check_mesh_arg(args)


def _check_flags_apply(args) -> None:
    """Refuses a method flag that none of the --methods takes (it would change nothing)."""
    from jaxspec.methods import MethodOptions
    from jaxspec.registry import METHOD_SPECS, OPTION_FLAGS, method_spec

    specs = [method_spec(entry.partition("=")[0]) for entry in args.methods]
    for field, flag in OPTION_FLAGS.items():
        value = getattr(args, field, None)
        default = MethodOptions.__dataclass_fields__[field].default
        given = value not in (None, []) and value != default  # --num-draft-tokens and --budget are lists here
        if given and not any(field in s.options for s in specs):
            takers = [s.name for s in METHOD_SPECS.values() if field in s.options]
            raise UserError(f"{flag} applies to none of --methods {','.join(args.methods)}; it is for "
                            f"{', '.join(takers)}.")


def _check_mesh_batches(args, prompt_sets: Mapping[str, Sequence]) -> None:
    """--mesh: every batch (the last, shorter one of a set included) must split over the data axis."""
    if getattr(args, "mesh", None) is None:
        return
    from jaxspec.sharding import parse_mesh

    data = parse_mesh(args.mesh)[0]
    for name, prompts in prompt_sets.items():
        for batch_size in args.batch_sizes:
            sizes = sorted({len(rows) for rows in _batches(prompts, batch_size)})
            if any(size % data for size in sizes):
                raise UserError(
                    f"--mesh {args.mesh}: the data axis of size {data} must divide every batch, but {name}'s "
                    f"{len(prompts)} prompts at batch size {batch_size} make batches of {sizes} rows; use batch "
                    f"sizes and a --limit that are multiples of {data}.")


def _options_for(spec, options):
    """`options` with what `spec` does not take set back to its defaults: in a bench over several methods, a flag
    applies to the methods that take it (`_check_args` refuses one that none of them takes)."""
    from jaxspec.methods import MethodOptions
    from jaxspec.registry import OPTION_FLAGS

    defaults = {f: MethodOptions.__dataclass_fields__[f].default for f in OPTION_FLAGS if f not in spec.options}
    return dataclasses.replace(options, **defaults)


def build_methods(target: LoadedModel, args) -> list[Method]:
    """Autoregressive, then each requested method once per K of --num-draft-tokens and per --budget where it takes
    them (once with its defaults otherwise)."""
    from jaxspec.arguments import method_options
    from jaxspec.methods import MethodOptions
    from jaxspec.registry import method_spec

    methods = [build_method(BASELINE, target, MethodOptions(mesh=getattr(args, "mesh", None)))]
    ks = args.num_draft_tokens or [None]
    budgets = getattr(args, "budget", None) or [None]
    for entry in args.methods:
        name, _, drafter = entry.partition("=")  # "medusa=runs/x/drafter" or "medusa=untrained" picks the drafter
        if name == BASELINE:
            continue
        spec = method_spec(name)
        for k in ks if "num_draft_tokens" in spec.options else [None]:
            for budget in budgets if spec.auto is not None else [None]:
                overrides = {"num_draft_tokens": k, "budget": None, **({"drafter": drafter} if drafter else {})}
                if budget is not None and spec.auto == "budget":
                    block = None
                    if spec.chain_budget and budget != "auto":  # a chain: at most the block size
                        block = _dflash_block_size(target, name, drafter or None)
                    overrides["budget"] = budget if block is None else min(budget, block)
                elif budget is not None:  # the EAGLE trees: auto (also their default) or N nodes; a chain: auto
                    if budget == "auto" or spec.auto == "chain":
                        overrides["budget"] = "auto"
                    else:
                        overrides["tree_nodes"] = budget
                options = _options_for(spec, method_options(argparse.Namespace(**{**vars(args), **overrides})))
                method = build_method(name, target, options)
                if drafter:
                    label = "untrained" if drafter == "untrained" else os.path.basename(os.path.dirname(
                        os.path.abspath(drafter))) or drafter
                    method.name = f"{name}[{label}]"
                if budget == "auto":
                    method.name += "[auto]"
                if any(_label(m) == _label(method) for m in methods):
                    continue  # the same run again (a dflash chain capped at its block size)
                methods.append(method)
    return methods


def _dflash_block_size(target: LoadedModel, name: str, drafter: str | None) -> int:
    """The block size of the block head a --methods entry names (the shipped or given checkpoint)."""
    from jaxspec.methods import MethodOptions, load_learned_drafter

    return load_learned_drafter(name, target, drafter, MethodOptions(drafter=drafter))[0].block_size


def cmd_bench(args) -> None:
    """Runs `jaxspec bench`: loads the model and prompt sets, chooses the CPU layout (`--layers`, default the one
    whose decoding step is faster here: `jaxspec.budget.chosen_layout`), runs `run_bench`, prints the table, writes
    outputs."""
    from jaxspec.arguments import check_mesh_arg, dtype_from_name
    from jaxspec.budget import chosen_layout
    from jaxspec.loading import load_model
    from jaxspec.model import layers_layout
    from jaxspec.prompts import load_prompt_set

    _check_args(args)
    texts = {name: load_prompt_set(name, args.limit) for name in args.prompt_sets}  # fails fast if not installed
    mesh = check_mesh_arg(args)
    target = load_model(args.model, dtype=dtype_from_name(args.dtype), mesh=mesh)
    if mesh is None:
        layout, why = chosen_layout(target, args.batch_sizes[0], args.layers)
        if why:
            print(why, file=sys.stderr)
    else:
        layout = "stacked"  # a mesh runs the stacked layers (jaxspec.model.execution_weights)
    with layers_layout(layout):
        _bench(args, target, texts, layout)


def _bench(args, target, texts: dict[str, list[str]], layout: str) -> None:
    import jax

    from jaxspec.tokenizer import encode_prompt

    if target.tokenizer is None:
        raise UserError(f"'{target.source}' has no tokenizer (tokenizer.json); the benchmark encodes text prompts.")
    prompt_sets = {name: [encode_prompt(target.tokenizer, t) for t in prompts] for name, prompts in texts.items()}
    _check_mesh_batches(args, prompt_sets)
    methods = build_methods(target, args)
    lookup_ks = [method_k(m) for m in methods if m.name == "prompt-lookup"] or [4]
    on = jax.default_backend() + (f", {layout} layers" if jax.default_backend() == "cpu" else "")
    print(f"jaxspec bench: {target.source} on {on} ({mesh_label(methods[0].mesh)}); methods "
          f"{', '.join(_label(m) for m in methods)}; sets {', '.join(prompt_sets)} "
          f"({args.limit} prompts each); T {args.temperatures}; batch {args.batch_sizes}; "
          f"{args.max_new_tokens} new tokens", file=sys.stderr)
    bench = run_bench(target, methods, prompt_sets, temperatures=args.temperatures, batch_sizes=args.batch_sizes,
                      max_new_tokens=args.max_new_tokens, seed=args.seed, peers=not args.no_peers,
                      peer_prompt_lookup_ks=lookup_ks, ngram=args.ngram, phases=args.phases)
    bench = {"command": shlex.join(["jaxspec", *sys.argv[1:]]), "model": args.model, "source": target.source,
             "dtype": str(target.weights.embed.dtype), "backend": jax.default_backend(), "layers": layout,
             "jax_version": jax.__version__, "cpu_count": os.cpu_count(), "limit": args.limit,
             "arguments": vars(args), "prompts": texts, **bench}
    written = write_outputs(bench, args.out)
    print(format_table(bench))
    print(f"\ntok/s = all new tokens / seconds of the timed runs (prefill included); speedup = tok/s over "
          f"autoregressive's on the same prompts; tau = tokens per verification round; theory = tau * L / (C + L), "
          f"C = drafting work in target layers (EAGLE: one layer x depth); ppsd/spd: tau = L'acc = alpha * n "
          f"(alpha = tokens per pipeline step; stages emulated on one device unless --stage-devices), theory = L'acc "
          f"(spd, drafting hidden) or L'acc * L / (Ls * n + L); accept@i = fraction of rounds "
          f"accepting draft position i; =AR: T=0 tokens equal autoregressive's. {WARMUP_NOTE.split(':')[0]}."
          + (" round ms: one round's wall time split by phase, from one profiled run of the first batch (op time "
             "shares; loop = the loop's own bookkeeping)." if args.phases else ""))
    if "skipped" in bench["peers"]:
        print(f"Peers skipped: {bench['peers']['skipped']}.")
    if "skipped" in bench.get("llama_cpp", {}):
        print(f"llama.cpp skipped: {bench['llama_cpp']['skipped']}.")
    print(f"Wrote {', '.join(written.values())}")
    if not bench["greedy_identical"]:
        print("\n" + "\n".join(bench["greedy_mismatches"]), file=sys.stderr)
