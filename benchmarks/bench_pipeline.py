"""Pipeline decoding sweep: SPD's L'acc against stage count n and drafter depth Ls, PPSD's and EAGLE-3's theoretical
speedups beside it, from the same prompts (METHODS.md's metrics).

    python benchmarks/bench_pipeline.py \\
        --spd ls1=runs/spd-smollm2-135m/drafter,ls2=runs/spd-ls2/drafter,ls3=runs/spd-ls3/drafter \\
        --spd-output ls1=runs/spd-ls1-output/drafter --stages 2,3,5,6,10,15 \\
        --prompt-sets mt-bench,gsm8k,humaneval --limit 3 --temperatures 0,1 --max-new-tokens 64 --out bench_out/issue7

Per prompt set and temperature, all prompts decode as one batch; the counters are summed over rows.
- SPD (input state, drafting hidden): L'acc = alpha * n, alpha = tokens generated / pipeline steps.
- SPD output state and PPSD (drafting waits for the step): theory = L'acc * L / (Ls * n + L), with Ls = 1 for PPSD's
  early-exit head.
- EAGLE-3 (the shipped drafter): theory = tau * L / (Ls * m + L), m = its tree depth.

Everything here is counted, not timed. The stages are emulated on one device, so the wall-clock time of a pipeline
step is a full decoding step here. Writes results.json, table.md and lacc_vs_stages.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxspec import metrics  # noqa: E402
from jaxspec.loading import load_model  # noqa: E402
from jaxspec.methods import MethodOptions, build_method  # noqa: E402
from jaxspec.prompts import load_prompt_set  # noqa: E402
from jaxspec.sampling import SamplingConfig  # noqa: E402
from jaxspec.tokenizer import encode_prompt  # noqa: E402


def _pairs(text: str) -> list[tuple[str, str]]:
    return [tuple(item.split("=", 1)) for item in text.split(",") if item] if text else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spd", default="", help="label=drafter folder,... of input-state SPD drafters")
    p.add_argument("--spd-output", default="", help="label=drafter folder,... of output-state SPD drafters")
    p.add_argument("--output-stages", default="5", help="stage counts for the output-state drafters")
    p.add_argument("--stages", default="2,3,5,6,10,15")
    p.add_argument("--prompt-sets", default="mt-bench,gsm8k,humaneval")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-eagle3", action="store_true")
    p.add_argument("--no-ppsd", action="store_true")
    p.add_argument("--tree-width", type=int, default=1, help="W lanes per drafted token (ppsd and spd)")
    p.add_argument("--out", default="bench_out/pipeline")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                   help="no runs: combine the rows of earlier results.json files into one table and plot under --out")
    args = p.parse_args(argv)
    if args.merge:
        rows, sets, temperatures = [], [], []
        for path in args.merge:
            with open(path) as f:
                rows += json.load(f)["rows"]
        sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
        temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
        write(args.out, {"merged": args.merge, "rows": rows}, rows, sets, temperatures)
        return 0
    from tqdm.auto import tqdm

    target = load_model(args.model)
    cfg = target.config
    stages = [int(x) for x in args.stages.split(",")]
    output_stages = [int(x) for x in args.output_stages.split(",") if x]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    sets = {name: [encode_prompt(target.tokenizer, t) for t in load_prompt_set(name, args.limit)]
            for name in args.prompt_sets.split(",")}
    runs = []  # (label, method name, options, stage count)
    if not args.no_eagle3:
        runs.append(("eagle3", "eagle3", MethodOptions(), None))
    w = args.tree_width
    tag = f" W={w}" if w > 1 else ""
    for n in stages:
        if not args.no_ppsd:
            runs.append((f"ppsd{tag} n={n}", "ppsd", MethodOptions(num_stages=n, tree_width=w), n))
        for label, path in _pairs(args.spd):
            runs.append((f"spd[{label}]{tag} n={n}", "spd", MethodOptions(drafter=path, num_stages=n, tree_width=w),
                         n))
    for n in output_stages:
        for label, path in _pairs(args.spd_output):
            runs.append((f"spd-output[{label}]{tag} n={n}", "spd",
                         MethodOptions(drafter=path, num_stages=n, tree_width=w), n))
    rows = []
    bar = tqdm(total=len(runs) * len(temperatures) * len(sets), desc="pipeline sweep", unit="run")
    started = time.perf_counter()
    for label, name, options, n in runs:
        method = build_method(name, target, options)
        for temperature in temperatures:
            sampling = SamplingConfig(temperature=temperature)
            for set_name, prompts in sets.items():
                result = method.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=0)
                row = {"label": label, "method": name, "prompt_set": set_name, "temperature": temperature,
                       "num_stages": n, "new_tokens": result.num_tokens}
                if method.is_pipeline:
                    ls = method.drafter.draft_cost_layers(cfg)
                    l_acc = result.equivalent_acceptance
                    row.update(draft_layers=ls, hides_drafting=method.drafter.hides_drafting, steps=result.steps,
                               bubbles=result.bubbles, exits=result.exits, rejections=result.rejections,
                               promotions=result.promotions, tree_width=method.drafter.tree_width,
                               alpha=result.alpha, equivalent_acceptance=l_acc,
                               theoretical_speedup=l_acc if method.drafter.hides_drafting else
                               metrics.ppsd_speedup(l_acc, cfg.num_layers, ls, n))
                else:
                    depth = method.drafter.depth
                    row.update(draft_layers=1, draft_steps=depth, tau=result.tau,
                               theoretical_speedup=metrics.eagle3_speedup(result.tau, cfg.num_layers, 1, depth))
                rows.append(row)
                bar.set_postfix_str(f"{label} {set_name} T={temperature:g}: theory "
                                    f"{row['theoretical_speedup']:.2f}")
                bar.update(1)
        jax.clear_caches()  # one compiled program per stage count and drafter: keep the memory maps bounded
    bar.close()
    write(args.out, {"command": " ".join(sys.argv), "model": args.model, "limit": args.limit,
                     "max_new_tokens": args.max_new_tokens, "seconds": time.perf_counter() - started, "rows": rows},
          rows, list(sets), temperatures)
    return 0


def write(out: str, record: dict, rows, set_names, temperatures) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(record, f, indent=2)
    table = format_table(rows, set_names, temperatures)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plot(rows, temperatures, os.path.join(out, "lacc_vs_stages.png"))
    print(f"Wrote {out}/results.json, table.md, lacc_vs_stages.png")


def format_table(rows, set_names, temperatures) -> str:
    """One line per run and temperature: L'acc (tau for EAGLE-3) / theoretical speedup per prompt set."""
    lines = ["| run | T | " + " | ".join(set_names) + " | mean theory |", "|---|---|" + "---|" * (len(set_names) + 1)]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        for t in temperatures:
            cells, theories = [], []
            for s in set_names:
                r = next(r for r in rows if r["label"] == label and r["temperature"] == t and r["prompt_set"] == s)
                acc = r.get("equivalent_acceptance", r.get("tau"))
                cells.append(f"{acc:.2f} / {r['theoretical_speedup']:.2f}")
                theories.append(r["theoretical_speedup"])
            lines.append(f"| {label} | {t:g} | " + " | ".join(cells) + f" | {np.mean(theories):.2f} |")
    return "\n".join(lines)


def plot(rows, temperatures, path) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(6 * len(temperatures), 4))
    axes = fig.subplots(1, len(temperatures), squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        families = sorted({r["label"].split(" n=")[0] for r in rows if r["num_stages"] is not None})
        for family in families:
            points = {}
            for r in rows:
                if r["temperature"] == t and r["num_stages"] is not None and r["label"].split(" n=")[0] == family:
                    points.setdefault(r["num_stages"], []).append(r["theoretical_speedup"])
            xs = sorted(points)
            ax.plot(xs, [np.mean(points[x]) for x in xs], marker="o", label=family)
        eagle = [r["theoretical_speedup"] for r in rows if r["method"] == "eagle3" and r["temperature"] == t]
        if eagle:
            ax.axhline(np.mean(eagle), color="gray", linestyle="--", label="eagle3")
        ax.set_xlabel("pipeline stages n")
        ax.set_ylabel("theoretical speedup (mean over sets)")
        ax.set_title(f"T={t:g}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
