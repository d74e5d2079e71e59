"""Where the time of a decoding step goes: a `jax.profiler` trace of the jitted loop, per-op times grouped.

    python benchmarks/profile_step.py                          # autoregressive, batch 1, 256 cache slots
    python benchmarks/profile_step.py --batch 16 --cache 1024
    python benchmarks/profile_step.py --method eagle3          # a speculative round: draft / verify / commit
    python benchmarks/profile_step.py --unstacked              # the layers as per-layer buffers (CPU)
    python benchmarks/profile_step.py --method eagle3 --by-op  # each phase split by kind of op
    python benchmarks/profile_step.py --method jetspec --drafter runs/jetspec-smollm2-135m/drafter --budget 4
    python benchmarks/profile_step.py --matmul                 # 30 chained 576 x 1536 products, stacked vs per layer
    python benchmarks/profile_step.py --attention              # attention over the cache: two product orientations

Per-op durations come from the trace; each op is attributed to the phase named in the compiled HLO's op_name
(the loop's `jax.named_scope`s: draft, verify, accept, commit). Ops of the two cores overlap, so the shares are what to
read, not the sums. See docs/cpu-performance.md for what these showed.
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.arguments import parse_budget
from jaxspec.generate import generate_tokens
from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.model import feature_major_layers, layers_layout
from jaxspec.profiling import op_scopes, traced_op_times
from jaxspec.sampling import SamplingConfig
from jaxspec.speculative import ROUND_PHASES


def _kind(op: str, scope: str, by_op: bool = False) -> str:
    """The group an op's time goes to: its phase (draft, verify, commit) or its kind of op; with `by_op`, both."""
    name = re.sub(r"[.\d]+$", "", op)
    for phase in ROUND_PHASES:
        if f"/{phase}/" in scope:
            return f"{phase}: {_op_kind(name)}" if by_op else phase
    return _op_kind(name)


def _op_kind(name: str) -> str:
    return {"dynamic-slice_bitcast_fusion": "weight slice copies", "ynn_fusion": "library matrix products",
            "dot": "matrix products"}.get(name, name)


def profile_loop(args) -> None:
    target = load_model(args.model)
    weights = feature_major_layers(target.weights) if args.unstacked else target.weights
    cfg, b = target.config, args.batch
    tokens = jnp.zeros((b, max(64, args.context)), jnp.int32)  # [B, P]
    lengths = jnp.full((b,), args.context, jnp.int32)  # [B]
    sampling = SamplingConfig(temperature=args.temperature)
    if args.method == "autoregressive":
        fn = generate_tokens
        call_args = (weights, cfg, tokens, lengths, jax.random.key(0))
        kwargs = dict(max_new_tokens=args.steps, cache_size=args.cache, sampling=sampling)
    else:
        from jaxspec.methods import MethodOptions, build_method
        from jaxspec.speculative import speculative_generate_tokens

        method = build_method(args.method, target, MethodOptions(drafter=args.drafter, budget=args.budget,
                                                                  num_draft_tokens=args.num_draft_tokens,
                                                                  tree_width=args.tree_width,
                                                                  tree_nodes=args.tree_nodes))
        drafter = method.drafter_for_batch(b, greedy=sampling.greedy)
        if drafter is None:
            raise SystemExit(f"--budget auto chose no draft for {args.method} at batch {b} (plain decoding is expected "
                             "to be faster): profile --method autoregressive, or give the tree by hand.")
        fn = speculative_generate_tokens
        if args.unstacked:  # the drafter's parameters as the loop runs them beside per-layer weights
            with layers_layout("unstacked"):
                params = drafter.execution_params(method.params)
        else:
            params = method.params
        call_args = (weights, cfg, drafter, params, tokens, lengths, jax.random.key(0))
        kwargs = dict(max_new_tokens=args.steps, cache_size=args.cache, sampling=sampling)
    run = lambda: jax.block_until_ready(fn(*call_args, **kwargs))  # noqa: E731
    run()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    rounds = args.steps if args.method == "autoregressive" else int(np.asarray(result[2]).max())
    compiled = fn.lower(*call_args, **kwargs).compile().as_text()
    scopes = op_scopes(compiled)
    kernels = dict(re.findall(r"%(\S+) = .*custom_call_target=\"([^\"]*)\"", compiled))  # ffi op -> its kernel
    times = traced_op_times(run)
    grouped = collections.Counter()
    for op, us in times.items():
        kind = _kind(op, scopes.get(op, ""), args.by_op)
        grouped[f"{kind} ({kernels[op]})" if op in kernels else kind] += us
    total = sum(grouped.values())
    print(f"{args.method}, batch {b}, {args.cache} cache slots, {'unstacked' if args.unstacked else 'stacked'} layers: "
          f"{seconds * 1e3 / rounds:.1f} ms per {'step' if args.method == 'autoregressive' else 'round'} "
          f"({rounds} of them)")
    for kind, us in grouped.most_common(args.top):
        print(f"  {us / 1e3 / rounds:8.2f} ms  {100 * us / total:5.1f}%  {kind}")


def profile_matmul(_args) -> None:
    """30 chained [M, 576] x [576, 1536] products: one stacked array scanned vs 30 separate buffers."""
    def best(f, n=15):
        f()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    stacked = np.random.default_rng(0).standard_normal((30, 576, 1536), np.float32)  # [L, d, f]
    stack = jnp.asarray(stacked)
    layers = [jnp.asarray(stacked[i]) for i in range(30)]

    def scan(ws, x):
        return jax.lax.scan(lambda c, w: (c + 1e-3 * (c @ w)[:, :576], None), x, ws)[0]

    def unrolled(ws, x, rowwise):
        for w in ws:
            y = jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])]) if rowwise else x @ w
            x = x + 1e-3 * y[:, :576]
        return x

    fs = {"stacked scan": (jax.jit(scan), stack),
          "per layer": (jax.jit(lambda ws, x: unrolled(ws, x, False)), layers),
          "per layer, 1-row products": (jax.jit(lambda ws, x: unrolled(ws, x, True)), layers)}
    print(f"30 chained products, {stacked.nbytes / 1e6:.0f} MB of weights; ms, best of 15")
    for m in (1, 2, 4, 8):
        x = jnp.ones((m, 576), jnp.float32)  # [M, d]
        print(f"  M={m}: " + "  ".join(f"{name} {best(lambda f=f, w=w, x=x: f(w, x).block_until_ready()):.1f}"
                                       for name, (f, w) in fs.items()))


def profile_attention(_args) -> None:
    """30 layers of attention over the cache (SmolLM2's shapes: 3 key/value heads of 64, 3 queries per head) with the
    cache as the left operand of the scores (the old orientation) and with the query left (jaxspec.model's now)."""
    def best(f, *a, n=5):
        jax.block_until_ready(f(*a))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(n):
                out = f(*a)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / n)
        return min(times) * 1e3

    def layers(orientation):
        def run(cache_k, cache_v, q, lengths):  # cache_*: L x [B, k, S, h]; q: [B, T, k, g, h]; lengths: [B]
            x = jnp.zeros_like(q)
            s = cache_k[0].shape[2]
            for k, v in zip(cache_k, cache_v):
                if orientation == "cache left":
                    scores = jnp.einsum("bksh,btkgh->bktgs", k, q + x).transpose(0, 1, 3, 2, 4)  # [B, k, g, T, S]
                else:
                    scores = jnp.einsum("btkgh,bksh->bkgts", q + x, k)  # [B, k, g, T, S]
                visible = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
                probs = jax.nn.softmax(jnp.where(visible[:, None, None, None, :], scores, -1e30), axis=-1)
                if orientation == "cache left":
                    out = jnp.einsum("bkgts,bksh->btkgh", probs, v)  # [B, T, k, g, h]
                else:
                    out = jnp.einsum("bkgts,bksh->bkgth", probs, v).transpose(0, 3, 1, 2, 4)
                x = x + 1e-3 * out
            return x
        return jax.jit(run)

    rng = np.random.default_rng(0)
    print("30 layers of attention over the cache, ms (best of 3)")
    for b, s, t in ((16, 384, 1), (64, 384, 1), (1, 384, 4), (1, 384, 16)):
        cache_k = [jnp.asarray(rng.standard_normal((b, 3, s, 64), np.float32)) for _ in range(30)]
        cache_v = [jnp.asarray(rng.standard_normal((b, 3, s, 64), np.float32)) for _ in range(30)]
        q = jnp.asarray(rng.standard_normal((b, t, 3, 3, 64), np.float32))
        lengths = jnp.full((b,), s // 2, jnp.int32)
        times = {o: best(layers(o), cache_k, cache_v, q, lengths) for o in ("cache left", "query left")}
        print(f"  B={b} S={s} T={t}: " + "  ".join(f"{o} {ms:.1f}" for o, ms in times.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--method", default="autoregressive", help="autoregressive or a round-based method (eagle3, ...)")
    p.add_argument("--drafter", default=None, help="the drafter folder (default: the method's shipped one)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="a chain of this many drafted tokens by hand (instead of --budget)")
    p.add_argument("--tree-width", type=int, default=None, help="with --num-draft-tokens: children a node (1: a chain)")
    p.add_argument("--tree-nodes", type=int, default=None, help="with --num-draft-tokens: verified nodes a round")
    p.add_argument("--budget", type=parse_budget, default=None, help="the method's --budget (a tree budget, or auto)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", type=int, default=256, help="cache slots per row")
    p.add_argument("--steps", type=int, default=33, help="new tokens")
    p.add_argument("--context", type=int, default=40, help="prompt tokens per row before the first step")
    p.add_argument("--unstacked", action="store_true", help="the layers as per-layer buffers (see jaxspec.model)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (the loops' Gumbel-max draw) instead of greedy decoding")
    p.add_argument("--by-op", action="store_true", help="split each phase (draft, verify, commit) by kind of op")
    p.add_argument("--matmul", action="store_true", help="the matrix-product microbenchmark instead")
    p.add_argument("--attention", action="store_true", help="the attention-orientation microbenchmark instead")
    args = p.parse_args()
    (profile_matmul if args.matmul else profile_attention if args.attention else profile_loop)(args)


if __name__ == "__main__":
    main()
