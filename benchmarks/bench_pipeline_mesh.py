"""Pipeline decoding with the stages on separate devices against the same stages emulated on one device, and
against autoregressive decoding, in one run (tokens/s side by side, greedy equality checked).

    python benchmarks/bench_pipeline_mesh.py --devices 5 --num-stages 5 --methods ppsd,spd=runs/spd-smollm2-135m/drafter

On a CPU the devices are fake (--xla_force_host_platform_device_count, set here before JAX starts): they share the
same cores, so this checks the plumbing and shows the per-step overhead of the mesh program, not a real pipeline's
speed. On a machine with several accelerators the same command lays the stages on real devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--devices", type=int, default=5)
    p.add_argument("--num-stages", type=int, default=5)
    p.add_argument("--methods", default="ppsd", help="ppsd and/or spd=DRAFTER, comma-separated")
    p.add_argument("--prompt-set", default="humaneval")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if "jax" not in sys.modules and jax_platform_is_cpu():
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax

    from jaxspec.loading import load_model
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.prompts import load_prompt_set
    from jaxspec.tokenizer import encode_prompt

    target = load_model(args.model)
    prompts = [encode_prompt(target.tokenizer, t) for t in load_prompt_set(args.prompt_set, args.limit)]
    runs = [("autoregressive", build_method("autoregressive", target))]
    for spec in args.methods.split(","):
        name, _, drafter = spec.partition("=")
        for devices in (1, args.devices):
            options = MethodOptions(num_stages=args.num_stages, stage_devices=devices, drafter=drafter or None)
            runs.append((f"{name} n={args.num_stages} on {devices} device(s)", build_method(name, target, options)))
    print(f"{target.source} on {len(jax.devices())} {jax.default_backend()} device(s); {len(prompts)} "
          f"{args.prompt_set} prompts one at a time, {args.max_new_tokens} new tokens", file=sys.stderr)
    rows, reference = [], None
    for label, method in runs:
        tokens, seconds, extra = [], 0.0, {}
        for ids in prompts:
            method.generate([ids], max_new_tokens=args.max_new_tokens)  # compile, warm up
            start = time.perf_counter()
            result = method.generate([ids], max_new_tokens=args.max_new_tokens)
            seconds += time.perf_counter() - start
            tokens += result.token_ids
            if method.is_pipeline:
                for name in ("steps", "bubbles", "exits", "rejections"):
                    extra[name] = extra.get(name, 0) + getattr(result, name)
        reference = reference or tokens
        row = {"run": label, "tokens_per_second": sum(map(len, tokens)) / seconds, "same_tokens": tokens == reference}
        if extra:
            row.update(extra, equivalent_acceptance=extra["exits"] / extra["steps"] * args.num_stages,
                       seconds_per_step=seconds / extra["steps"])
        rows.append(row)
        jax.clear_caches()
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / base
        tail = (f", L'acc {row['equivalent_acceptance']:.2f}, {1000 * row['seconds_per_step']:.1f} ms per step"
                if "steps" in row else "")
        print(f"{row['run']:<34} {row['tokens_per_second']:7.1f} tok/s  {row['speedup']:.2f}x  "
              f"same tokens: {row['same_tokens']}{tail}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def jax_platform_is_cpu() -> bool:
    """True unless JAX_PLATFORMS names an accelerator (the fake-device flag only applies to the CPU backend)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return not platforms or "cpu" in platforms


if __name__ == "__main__":
    sys.exit(main())
