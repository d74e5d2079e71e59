"""The device check: autoregressive decoding and the main methods on one accelerator, in one run, as a table.

    python benchmarks/accelerator.py                      # on a GPU or TPU host: bfloat16, batch 1, 8 and 32
    python benchmarks/accelerator.py --tiny               # the same on CPU with tiny settings (the test suite's)

Runs `jaxspec bench` (autoregressive decoding timed beside each method, greedy outputs checked equal) for the
methods that need no training run here: prompt lookup and the shipped EAGLE-3 drafter of SmolLM2-135M-Instruct
(`--budget auto`, which sizes the tree from this device's measured verification cost), on the --limit first
MT-Bench prompts at each batch size, 128 new tokens. Writes into --out the bench's own files (results.json,
results.md, plots) and accelerator.md: the device, the date, and one table of tokens/s, tau and speedup per method
and batch size, ready for the README. Sized for about 8 minutes on one H200 including compilation (--limit 32: a
batch-32 run is one batch); --limit 16 --batch-sizes 1,8,16 took 192 s there on 2026-12-04.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

DEFAULTS = dict(methods="autoregressive,prompt-lookup,eagle3", batch_sizes="1,8,32", limit=32, max_new_tokens=128)
TINY = dict(methods="autoregressive,prompt-lookup", batch_sizes="1,2", limit=2, max_new_tokens=8)


def device_name() -> str:
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or device.platform
    return f"{len(jax.devices())} x {kind} ({jax.default_backend()})"


def table(results: list[dict]) -> str:
    """Markdown: one row per method and batch size (the bench's T=0 rows)."""
    lines = ["| method | batch | tok/s | tau | speedup | greedy = autoregressive |", "|---|---|---|---|---|---|"]
    for row in results:
        if row.get("temperature", 0.0) != 0.0 or "batch_size" not in row:  # T=0 jaxspec rows only
            continue
        tau, speedup, same = row.get("tau"), row.get("speedup"), row.get("matches_autoregressive")
        lines.append(f"| {row.get('label', row['method'])} | {row['batch_size']} | {row['tokens_per_second']:.1f} | "
                     f"{'-' if tau is None else f'{tau:.2f}'} | {'-' if speedup is None else f'{speedup:.2f}x'} | "
                     f"{'-' if same is None else ('yes' if same else 'NO')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU check: 2 prompts, batch 1 and 2, 8 new tokens, "
                   "autoregressive and prompt lookup, float32")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=None, help=f"default {DEFAULTS['methods']}")
    p.add_argument("--batch-sizes", default=None, help=f"default {DEFAULTS['batch_sizes']}")
    p.add_argument("--limit", type=int, default=None, help=f"prompts (default {DEFAULTS['limit']})")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--out", default="bench_out/accelerator")
    args = p.parse_args(argv)
    settings = dict(TINY if args.tiny else DEFAULTS)
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")

    from jaxspec.cli import main as jaxspec_main

    status = jaxspec_main(["bench", "--model", args.model, "--dtype", dtype, "--methods", settings["methods"],
                           "--prompt-sets", "mt-bench", "--limit", str(settings["limit"]),
                           "--batch-sizes", settings["batch_sizes"], "--max-new-tokens",
                           str(settings["max_new_tokens"]), "--no-peers", "--out", args.out])
    if status:
        return status
    with open(os.path.join(args.out, "results.json")) as f:
        bench = json.load(f)
    text = (f"## Device check ({datetime.date.today().isoformat()}, {device_name()}, {args.model} in {dtype})\n\n"
            f"`python benchmarks/accelerator.py {' '.join(argv if argv is not None else sys.argv[1:])}`: "
            f"{settings['limit']} MT-Bench prompts, {settings['max_new_tokens']} new tokens, T=0, compilation "
            "excluded; speedups over autoregressive decoding in the same run.\n\n" + table(bench["results"]) + "\n")
    if dtype != "float32":  # measured on an H200 (README, 2026-12-04)
        text += (f"\nIn {dtype} greedy outputs may part from autoregressive ones: verifying T tokens in one "
                 "forward sums the products in another order than decoding them one by one, which can flip a near tie. "
                 "`--dtype float32` with JAX_DEFAULT_MATMUL_PRECISION=highest checks identity.\n")
    with open(os.path.join(args.out, "accelerator.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
