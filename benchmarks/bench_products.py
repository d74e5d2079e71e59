"""XLA's product against jaxspec's few-column kernel on SmolLM2's per-layer matrix shapes:
`python benchmarks/bench_products.py [--layers 10] [--columns 1,2,3,4,5,6,7,8]`.

Each of --layers layers contributes [960, 576] (q, k, v), [576, 576] (o), [3072, 576] (gate, up) and [576, 1536]
(down), float32, random: 142 MB at 10 layers, more than the caches. One jitted chain through all of them per column
count, by `jnp.matmul` and by `jaxspec.kernels.kernel_product` timed in turn (best of 9), printed in ms and GB/s of
weights read.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of SmolLM2-135M's per-layer products


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--columns", default="1,2,3,4,5,6,7,8")
    args = parser.parse_args()
    why_not = kernels.load_kernel()
    if why_not is not None:
        raise SystemExit(f"the kernel is unavailable here: {why_not}")
    rng = np.random.default_rng(0)
    matrices = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)  # [out, in]
                for _ in range(args.layers) for shape in SHAPES]
    megabytes = sum(w.size for w in matrices) * 4 / 1e6

    def chain(product):
        def run(matrices, x):  # x [576, N]
            for w in matrices:
                repeats = -(-w.shape[1] // x.shape[0])
                x = jnp.tanh(product(w, jnp.tile(x, (repeats, 1))[:w.shape[1]]))  # [out, N]
            return x
        return jax.jit(run)

    runs = {"xla": chain(jnp.matmul), "kernel": chain(kernels.kernel_product)}
    print(f"{len(matrices)} matrices, {megabytes:.0f} MB")
    for n in [int(c) for c in args.columns.split(",")]:
        x = jnp.full((576, n), 1e-3, jnp.float32)  # [576, N]
        for run in runs.values():
            jax.block_until_ready(run(matrices, x))
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(9):
            for name, run in runs.items():
                start = time.perf_counter()
                jax.block_until_ready(run(matrices, x))
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"N={n:>2}: " + "  ".join(f"{name} {s * 1e3:6.2f} ms ({megabytes / s / 1e3:4.1f} GB/s)"
                                        for name, s in best.items()), flush=True)


if __name__ == "__main__":
    main()
