"""A decoding step in each CPU weight layout, timed in turn in one process:
`python benchmarks/bench_layouts.py [--batch-sizes 1,16,64] [--cache 256]`.

Layouts: `stacked` (one array per weight with a leading layer axis, scanned: the default), `row-major` (one buffer
per layer, [in, out] matrices times [N, in] rows), `feature-major` (one buffer per layer, [out, in] matrices times
[in, N] activations: what JAXSPEC_LAYERS=unstacked runs, `jaxspec.model.feature_major_layers`). The per-layer
layouts decode over a per-layer cache. On a shared host the machine's speed drifts by tens of percent between
processes and minutes, so only a comparison timed in turn like this one is fair (docs/cpu-performance.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxspec.generate import generate_tokens
from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.model import feature_major_layers, unstack_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--cache", type=int, default=256, help="cache slots per row")
    parser.add_argument("--steps", type=int, default=33, help="decoding steps timed (prefill subtracted)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model, with_tokenizer=False)
    cfg = model.config
    layouts = {"stacked": model.weights, "row-major": unstack_layers(model.weights),
               "feature-major": feature_major_layers(model.weights)}
    print(f"{'batch':>5} " + " ".join(f"{name + ' ms/step':>22}" for name in layouts) + "   (tok/s over all rows)")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        tokens = jnp.zeros((b, 64), jnp.int32)  # [B, 64]
        lengths = jnp.full((b,), 40, jnp.int32)  # [B]: a 40-token context per row

        def run(weights, n, tokens=tokens, lengths=lengths):
            start = time.perf_counter()
            jax.block_until_ready(generate_tokens(weights, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=n,
                                                  cache_size=args.cache))
            return time.perf_counter() - start

        for weights in layouts.values():  # compile both lengths
            run(weights, args.steps)
            run(weights, 1)
        best = {name: float("inf") for name in layouts}
        for _ in range(args.repeats):
            for name, weights in layouts.items():
                best[name] = min(best[name], (run(weights, args.steps) - run(weights, 1)) / (args.steps - 1))
        print(f"{b:>5} " + " ".join(f"{best[n] * 1e3:>12.1f} ({b / best[n]:>6.1f}/s)" for n in layouts), flush=True)


if __name__ == "__main__":
    main()
