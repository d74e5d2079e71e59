"""Autoregressive (no speculation) decoding speed of jaxspec, next to the memory-bandwidth bound and transformers.

What it measures, for each batch size (default 1 and 8):

* jaxspec `generate` greedy with EOS disabled, so every row makes exactly --max-new-tokens tokens: tokens/s
  (all rows' new tokens / wall seconds, best and median of --repeats runs after one compiling warm-up run),
  the prefill time (a 1-token generation) and ms per decode step ((total - prefill) / (new tokens - 1));
* the memory-bandwidth bound: this machine's read bandwidth (best of a jitted `jnp.sum` and `np.add.reduce`
  over a 1 GiB float32 array) divided by the bytes of weights one decode step reads (every weight once, the
  tied embedding once as LM head, in bfloat16 where the CPU layout screens it, plus one embedding row for the
  lookup; the KV cache is not counted). A step
  serves every row of the batch, so the bound on tokens/s at batch B is B times the batch-1 bound;
* transformers + torch (when both import and --no-torch is not given): the same GGUF file through
  `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)` on 2 torch threads
  (--torch-threads), `model.generate(..., do_sample=False, min_new_tokens=N, max_new_tokens=N)` on the same
  prompts (left-padded for batches), and whether the first prompt's greedy tokens are identical in both
  (compared up to jaxspec's first EOS, since min_new_tokens makes transformers skip EOS).

How to run (in the project environment; prints progress, then a table and the exact command line):

    python benchmarks/bench_ar.py
    python benchmarks/bench_ar.py --batch-sizes 1,4,8 --max-new-tokens 64 --repeats 5 --json ar.json
    python benchmarks/bench_ar.py --no-torch

The transformers column needs `pip install torch==2.13.0 accelerate` (transformers needs accelerate to read
GGUF); without torch that column is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxspec.budget import chosen_layout
from jaxspec.generate import generate
from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.model import layers_layout
from jaxspec.tokenizer import encode_prompt

# Varied chat prompts, each well under 64 tokens once chat-templated (one prompt-width bucket: one compilation).
# The first one (batch 1, and the greedy check) has a long answer, so the check covers all 128 tokens.
PROMPTS = [
    "What is the difference between a list and a tuple in Python?",
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about the ocean.",
    "Summarize the plot of Romeo and Juliet.",
]

BANDWIDTH_BYTES = 1 << 30  # 1 GiB float32 array
BANDWIDTH_REPEATS = 7


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="known model name, .gguf file or HF folder")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated, e.g. 1,8")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (after one warm-up)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers + torch comparison")
    p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads for transformers")
    p.add_argument("--layers", choices=("auto", "stacked", "unstacked"), default=None,
                   help="CPU weight layout; default: $JAXSPEC_LAYERS if set, else auto: at each batch size the layout "
                        "whose decoding step is faster here, as `jaxspec generate` and `jaxspec bench` choose it "
                        "(measured once per machine and batch size, cached)")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes needs positive integers, e.g. 1,8")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be at least 2 (one prefill token plus decode steps)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def rows_for(prompt_ids: list[list[int]], batch: int) -> list[list[int]]:
    """The first `batch` prompts, cycling when the batch is larger than the prompt set."""
    return [prompt_ids[i % len(prompt_ids)] for i in range(batch)]


# ---------------------------------------------------------------------------------------------- bandwidth


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _best_sum_seconds(array, reduce) -> float:
    reduce(array)  # compile / page in
    return best_seconds(functools.partial(reduce, array), BANDWIDTH_REPEATS)


def measure_bandwidth() -> dict:
    """Read bandwidth in GB/s (1e9 bytes/s) of summing a 1 GiB float32 array: jitted jnp.sum and np.add.reduce."""
    n = BANDWIDTH_BYTES // 4
    total = jax.jit(jnp.sum)
    jax_s = _best_sum_seconds(jnp.ones((n,), jnp.float32), lambda x: total(x).block_until_ready())
    numpy_s = _best_sum_seconds(np.ones((n,), np.float32), np.add.reduce)
    jax_gbs, numpy_gbs = BANDWIDTH_BYTES / jax_s / 1e9, BANDWIDTH_BYTES / numpy_s / 1e9
    return {"jax_sum_gb_s": jax_gbs, "numpy_reduce_gb_s": numpy_gbs, "gb_s": max(jax_gbs, numpy_gbs)}


def weight_bytes_per_step(loaded) -> int:
    """Bytes of weights one greedy decode step reads: all weights once, the input embedding only one row, and the LM
    head as its bfloat16 screen where the layout in use has one (`jaxspec.model.greedy_tokens`: the CPU layout),
    plus the float32 rows of its 8 candidates."""
    from jaxspec.model import SCREEN_CANDIDATES, execution_weights

    cfg = loaded.config
    itemsize = jnp.dtype(loaded.weights.embed.dtype).itemsize
    embed = cfg.vocab_size * cfg.hidden_size
    # num_parameters counts a tied embedding once (read in full as LM head); an untied one is only looked up.
    params = cfg.num_parameters() - (0 if cfg.tie_word_embeddings else embed) + cfg.hidden_size
    if execution_weights(loaded.weights).head_screen is not None:  # the head read in bfloat16, not in full
        return itemsize * params - (itemsize - 2) * embed + itemsize * SCREEN_CANDIDATES * cfg.hidden_size
    return itemsize * params


# ---------------------------------------------------------------------------------------------- jaxspec


def bench_jaxspec(loaded, prompt_ids, batch: int, n: int, repeats: int) -> dict:
    rows = rows_for(prompt_ids, batch)

    def run(k):
        return generate(loaded.weights, loaded.config, rows, max_new_tokens=k, eos_ids=())

    start = time.perf_counter()
    run(n)
    run(1)
    warmup_s = time.perf_counter() - start
    prefill, total, result = [], [], None
    for _ in tqdm(range(repeats), desc=f"jaxspec batch {batch}", unit="run", leave=False):
        prefill.append(run(1).seconds)
        result = run(n)
        if any(len(t) != n for t in result.token_ids):
            raise RuntimeError("a row did not make exactly max_new_tokens tokens with EOS disabled")
        total.append(result.seconds)
    tokens = batch * n
    step_ms = (min(total) - min(prefill)) / (n - 1) * 1e3
    out = {
        "batch": batch,
        "tokens_per_s_best": tokens / min(total),
        "tokens_per_s_median": tokens / statistics.median(total),
        "ms_per_step": step_ms,
        "prefill_ms": min(prefill) * 1e3,
        "warmup_s": warmup_s,
        "seconds": total,
        "prefill_seconds": prefill,
        "first_row_tokens": result.token_ids[0],
    }
    print(f"  jaxspec batch {batch}: {out['tokens_per_s_best']:.1f} tok/s best, {out['tokens_per_s_median']:.1f} "
          f"median, {step_ms:.2f} ms/step, prefill {out['prefill_ms']:.1f} ms (warm-up/compile {warmup_s:.1f} s)")
    return out


# ---------------------------------------------------------------------------------------------- transformers


def bench_transformers(source: str, prompt_ids, batch_sizes, n: int, repeats: int, pad_id: int, threads: int) -> dict:
    """Times transformers + torch generate on the same prompts; torch is imported only here."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    versions = f"transformers {transformers.__version__} (torch {torch.__version__}, {threads} threads)"
    print(f"Loading {source} in {versions}...")
    if os.path.isdir(source):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(source), gguf_file=os.path.basename(source), dtype=torch.float32
        )
    model.eval()
    results = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
               "torch_threads": threads, "batches": {}}
    for batch in batch_sizes:
        rows = rows_for(prompt_ids, batch)
        width = max(len(r) for r in rows)
        ids = np.full((batch, width), pad_id, np.int64)
        mask = np.zeros((batch, width), np.int64)
        for i, r in enumerate(rows):  # left padding
            ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
        input_ids, attention_mask = torch.from_numpy(ids), torch.from_numpy(mask)

        def run(input_ids=input_ids, attention_mask=attention_mask):
            with torch.no_grad():
                return model.generate(
                    input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
                )

        run()  # warm-up
        total, out = [], None
        for _ in tqdm(range(repeats), desc=f"transformers batch {batch}", unit="run", leave=False):
            start = time.perf_counter()
            out = run()
            total.append(time.perf_counter() - start)
        new = out[:, width:].numpy()
        if new.shape[1] != n:
            raise RuntimeError(f"transformers made {new.shape[1]} tokens, not {n}")
        r = {
            "batch": batch,
            "tokens_per_s_best": batch * n / min(total),
            "tokens_per_s_median": batch * n / statistics.median(total),
            "ms_per_token_step": min(total) / n * 1e3,
            "seconds": total,
            "first_row_tokens": new[0].tolist(),
        }
        results["batches"][batch] = r
        print(f"  transformers batch {batch}: {r['tokens_per_s_best']:.1f} tok/s best, "
              f"{r['tokens_per_s_median']:.1f} median")
    return results


def compare_greedy(jax_tokens: list[int], torch_tokens: list[int], eos_ids) -> dict:
    """Compares up to (not including) jaxspec's first EOS: min_new_tokens makes transformers skip EOS there."""
    cut = next((i for i, t in enumerate(jax_tokens) if t in eos_ids), len(jax_tokens))
    a, b = jax_tokens[:cut], torch_tokens[:cut]
    mismatch = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"identical": mismatch is None, "compared_tokens": cut, "first_mismatch": mismatch,
            "stopped_at_eos": cut < len(jax_tokens)}


# ---------------------------------------------------------------------------------------------- report


def fmt(x, spec=".1f", missing="-") -> str:
    return missing if x is None else format(x, spec)


def print_table(res: dict) -> None:
    bound = res["bound_tokens_per_s"]
    torch_b = (res.get("transformers") or {}).get("batches", {})
    header = (f"{'':<32}{'tok/s best':>11}{'tok/s med':>11}{'ms/step':>9}{'prefill ms':>11}{'bound tok/s':>12}"
              f"{'of bound':>9}{'vs transformers':>16}")
    lines = [header, "-" * len(header)]
    for r in res["jaxspec"]:
        b = r["batch"]
        ref = torch_b.get(b)
        ratio = None if ref is None else r["tokens_per_s_best"] / ref["tokens_per_s_best"]
        label = f"jaxspec batch {b} ({r['layout']})"
        lines.append(
            f"{label:<32}{fmt(r['tokens_per_s_best']):>11}{fmt(r['tokens_per_s_median']):>11}"
            f"{fmt(r['ms_per_step'], '.2f'):>9}{fmt(r['prefill_ms']):>11}{fmt(b * bound):>12}"
            f"{fmt(r['tokens_per_s_best'] / (b * bound), '.0%'):>9}{fmt(ratio, '.2f') + ('x' if ratio else ''):>16}"
        )
    lines.append(f"{'bandwidth bound (batch 1)':<32}{fmt(bound):>11}{'':>11}{fmt(1e3 / bound, '.2f'):>9}")
    for b, ref in torch_b.items():
        lines.append(
            f"{f'transformers batch {b}':<32}{fmt(ref['tokens_per_s_best']):>11}{fmt(ref['tokens_per_s_median']):>11}"
            f"{fmt(ref['ms_per_token_step'], '.2f'):>9}{'':>11}{fmt(b * bound):>12}"
            f"{fmt(ref['tokens_per_s_best'] / (b * bound), '.0%'):>9}"
        )
    print("\n".join(lines))
    bw = res["bandwidth"]
    print(f"\nBandwidth {bw['gb_s']:.1f} GB/s (jnp.sum {bw['jax_sum_gb_s']:.1f}, np.add.reduce "
          f"{bw['numpy_reduce_gb_s']:.1f}); weights read per step {res['weight_bytes_per_step'] / 1e6:.1f} MB "
          f"({res['dtype']}, {res['num_parameters'] / 1e6:.1f}M parameters).")
    print("tok/s = all rows' new tokens / wall seconds (prefill included); ms/step = (total - prefill) / (N - 1); "
          "bound tok/s = batch x bandwidth / weight bytes per step.")
    if "transformers" in res:
        g = res["greedy_check"]
        if g["identical"]:
            verdict = f"IDENTICAL over {g['compared_tokens']} tokens"
            if g["stopped_at_eos"]:
                verdict += " (up to jaxspec's EOS; transformers skips EOS with min_new_tokens)"
        else:
            verdict = f"DIFFERENT from token {g['first_mismatch']} of {g['compared_tokens']} compared"
        print(f"Greedy tokens of the first prompt, jaxspec vs transformers: {verdict}.")
    else:
        print(f"transformers: {res.get('transformers_skipped', 'skipped')}.")
    print(f"Command: {res['command']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    command = shlex.join([os.path.basename(sys.executable), *sys.argv]) if argv is None else shlex.join(argv)
    n = args.max_new_tokens
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{os.cpu_count()} CPUs, {platform.machine()}")

    print(f"Loading {args.model} (float32)...")
    loaded = load_model(args.model, dtype=jnp.float32)
    if loaded.tokenizer is None:
        raise SystemExit(f"{loaded.source} has no tokenizer; the benchmark needs one to encode its chat prompts.")
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in PROMPTS]
    print(f"{len(PROMPTS)} chat prompts, {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens; "
          f"{n} new tokens per row; batch sizes {args.batch_sizes}; {args.repeats} repeats")

    # each batch size in the layout jaxspec's own commands would run it in (its fastest plain decoding here)
    layouts = {batch: chosen_layout(loaded, batch, args.layers)[0] for batch in args.batch_sizes}
    print("layouts:", ", ".join(f"batch {b} {layout}" for b, layout in layouts.items()))
    print("Measuring memory read bandwidth (1 GiB float32 sum)...")
    bandwidth = measure_bandwidth()
    with layers_layout(layouts[args.batch_sizes[0]]):  # the bytes a step reads depend on the layout (head screen)
        weight_bytes = weight_bytes_per_step(loaded)
    bound = bandwidth["gb_s"] * 1e9 / weight_bytes
    print(f"  {bandwidth['gb_s']:.1f} GB/s; {weight_bytes / 1e6:.1f} MB of weights per step -> "
          f"bound {bound:.1f} tok/s at batch 1")

    res = {
        "command": command,
        "model": args.model,
        "source": loaded.source,
        "dtype": "float32",
        "num_parameters": loaded.config.num_parameters(),
        "max_new_tokens": n,
        "repeats": args.repeats,
        "prompts": PROMPTS,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "bandwidth": bandwidth,
        "weight_bytes_per_step": weight_bytes,
        "bound_tokens_per_s": bound,
        "jaxspec": [],
    }
    print("jaxspec generate (greedy, EOS disabled):")
    for batch in args.batch_sizes:
        with layers_layout(layouts[batch]):
            res["jaxspec"].append({**bench_jaxspec(loaded, prompt_ids, batch, n, args.repeats),
                                   "layout": layouts[batch]})

    if args.no_torch:
        res["transformers_skipped"] = "skipped (--no-torch)"
    else:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            res["transformers_skipped"] = f"skipped ({e}; pip install torch==2.13.0 accelerate)"
        else:
            tok = loaded.tokenizer
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
            res["transformers"] = bench_transformers(loaded.source, prompt_ids, args.batch_sizes, n, args.repeats,
                                                     pad_id, args.torch_threads)
            jax_first = res["jaxspec"][0]
            torch_first = res["transformers"]["batches"][jax_first["batch"]]
            res["greedy_check"] = compare_greedy(jax_first["first_row_tokens"], torch_first["first_row_tokens"],
                                                 set(loaded.config.eos_token_ids))

    print()
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"Results written to {args.json}")


if __name__ == "__main__":
    main()
