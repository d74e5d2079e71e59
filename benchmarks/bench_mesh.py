"""Throughput on a (data, model) device mesh against one device, over batch sizes, for several methods in one run.

    python benchmarks/bench_mesh.py --mesh data=8,model=1 --batch-sizes 8,16,32
    python benchmarks/bench_mesh.py --mesh data=8,model=1 --mesh data=2,model=4 --model path/to/hf-folder
    python benchmarks/bench_mesh.py --fake-devices 8 --mesh data=8,model=1 --methods autoregressive,prompt-lookup \\
        --batch-sizes 8 --max-new-tokens 16 --limit 8

Every method (autoregressive always first, as the baseline) decodes the same prompts greedily at every batch size,
once on one device and once on each --mesh (`jaxspec.methods.MethodOptions(mesh=...)`). The --limit prompts of
--prompt-set are decoded in full batches (cycled to fill the last batch). Compilation is excluded: each compiled
shape of each configuration runs once untimed first. Reported per configuration: tokens/s (all new tokens / the
seconds of the timed runs, prefill included), tau (tokens per verification round, speculative methods), the ratio
to autoregressive on the same mesh and batch size, the ratio to the same method on one device, and whether the
tokens equal the one-device tokens (greedy; a model axis > 1 sums in another order, so rare float ties may differ).

Combinations the mesh refuses are skipped with the reason printed: a batch the data axis does not divide, a model
the model axis does not split (SmolLM2-135M has 9 heads and 3 key/value heads: model=1 or 3), a mesh whose sizes
do not multiply to the device count, a method or drafter that cannot be built.

--fake-devices N re-runs this script with N fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N,
JAX_PLATFORMS=cpu): they share the same cores, so that checks the plumbing and shows the mesh program's overhead,
not the speed of N devices.

Writes results.json and throughput_vs_batch.png into --out (default bench_out/mesh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

ONE_DEVICE = "1 device"
FAKE_DEVICE_NOTE = ("fake CPU devices share this machine's cores: this run checks the mesh plumbing and the mesh "
                    "program's overhead, not the speed of real devices")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got '{text}'")
    return values


def _name_list(text: str) -> list[str]:
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a known name, a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--mesh", action="append", default=None,
                   help="a mesh to compare with one device, e.g. data=8,model=1 (repeat for several); default: "
                        "data=<all devices>,model=1")
    p.add_argument("--methods", type=_name_list, default=_name_list("autoregressive,prompt-lookup,eagle3"),
                   help="comma list (default autoregressive,prompt-lookup,eagle3); autoregressive always runs as the "
                        "baseline; a learned method may name its drafter: eagle3=runs/x/drafter")
    p.add_argument("--batch-sizes", type=_int_list, default=[8, 16, 32], help="comma list (default 8,16,32)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-set", default="mt-bench", help="mt-bench, gsm8k or humaneval (default mt-bench)")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts of the set to decode (default: the largest batch size); each batch size decodes "
                        "them all in full batches, cycling the prompts to fill the last one")
    p.add_argument("--fake-devices", type=int, default=None,
                   help="re-run with N fake CPU devices (plumbing check, not speed)")
    p.add_argument("--out", default="bench_out/mesh", help="folder for results.json and throughput_vs_batch.png")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.fake_devices is not None and args.fake_devices < 1:
        p.error(f"--fake-devices must be at least 1, got {args.fake_devices}")
    return args


def _reexec_with_fake_devices(n: int, argv: list[str]) -> None:
    """Replaces this process with the same command under N fake CPU devices (the flag must precede JAX's start)."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if flag in os.environ.get("XLA_FLAGS", "") and os.environ.get("JAX_PLATFORMS") == "cpu":
        return  # already the re-run
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*kept, flag])
    print(f"bench_mesh: re-running with {n} fake CPU devices (XLA_FLAGS={env['XLA_FLAGS']}, JAX_PLATFORMS=cpu); note: "
          f"{FAKE_DEVICE_NOTE}.", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


def _batches(prompts: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """All prompts in full batches of `batch_size`, cycling them to fill the last batch."""
    total = math.ceil(max(len(prompts), batch_size) / batch_size) * batch_size
    rows = [prompts[i % len(prompts)] for i in range(total)]
    return [rows[i: i + batch_size] for i in range(0, total, batch_size)]


def _time(method, batches, max_new_tokens: int) -> dict:
    """Decodes every batch once, after an untimed run on each newly compiled shape; tokens, seconds and tau."""
    from jaxspec import metrics
    from jaxspec.bench import _shape_key
    from jaxspec.sampling import GREEDY

    compiled, token_ids, accepted = set(), [], []
    seconds = warmup = 0.0
    for rows in batches:
        key = _shape_key(method, rows, max_new_tokens, GREEDY)
        if key not in compiled:
            start = time.perf_counter()
            method.generate(rows, max_new_tokens=max_new_tokens)
            warmup += time.perf_counter() - start
            compiled.add(key)
        result = method.generate(rows, max_new_tokens=max_new_tokens)
        seconds += result.seconds
        token_ids += result.token_ids
        accepted += getattr(result, "accepted", None) or []
    new_tokens = sum(map(len, token_ids))
    tau = metrics.tau(accepted) if accepted else None
    return {"new_tokens": new_tokens, "seconds": seconds, "warmup_seconds": warmup,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else None,
            "tau": None if tau is None or math.isnan(tau) else tau, "token_ids": token_ids}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    header = ["method", "mesh", "batch", "tokens/s", "tau", "vs AR", "vs 1 device", "same tokens"]
    lines = [[r["label"], r["mesh"], str(r["batch_size"]), _fmt(r["tokens_per_second"], ".1f"), _fmt(r["tau"], ".2f"),
              _fmt(r["ratio_to_autoregressive"], ".2f") + ("x" if r["ratio_to_autoregressive"] else ""),
              _fmt(r["ratio_to_one_device"], ".2f") + ("x" if r["ratio_to_one_device"] else ""),
              {None: "-", True: "yes", False: "no"}[r["same_tokens_as_one_device"]]] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), "-" * len(fmt(header)), *(fmt(line) for line in lines)])


def plot(rows: list[dict], path: str) -> None:
    """tokens/s against batch size: a colour per method, a line style and marker per mesh (solid: one device)."""
    import matplotlib.ticker
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    labels = list(dict.fromkeys(r["label"] for r in rows))
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, label in enumerate(labels):
        for j, mesh in enumerate(meshes):
            points = sorted((r["batch_size"], r["tokens_per_second"]) for r in rows
                            if r["label"] == label and r["mesh"] == mesh and r["tokens_per_second"])
            if points:
                ax.plot([b for b, _ in points], [t for _, t in points], color=colors[i % len(colors)],
                        marker=markers[j % len(markers)], linestyle=styles[j % len(styles)], label=f"{label} / {mesh}")
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sorted({r["batch_size"] for r in rows}), [str(b) for b in sorted({r["batch_size"] for r in rows})])
    ax.set_xlabel("batch size (rows)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Throughput vs batch size: one device and device meshes")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.fake_devices is not None:
        _reexec_with_fake_devices(args.fake_devices, argv)  # returns only in the re-run
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax
    from tqdm import tqdm

    from jaxspec.arguments import dtype_from_name
    from jaxspec.bench import mesh_label
    from jaxspec.errors import UserError
    from jaxspec.loading import load_model
    from jaxspec.methods import METHODS, MethodOptions, build_method
    from jaxspec.prompts import load_prompt_set
    from jaxspec.sharding import check_divisible
    from jaxspec.tokenizer import encode_prompt

    started = time.perf_counter()
    names = ["autoregressive", *(m for m in args.methods if m.partition("=")[0] != "autoregressive")]
    for spec in names:
        if spec.partition("=")[0] not in METHODS:
            print(f"bench_mesh: unknown method '{spec}'; choose from {', '.join(METHODS)}", file=sys.stderr)
            return 2
    meshes = args.mesh or [f"data={len(jax.devices())},model=1"]
    limit = args.limit or max(args.batch_sizes)
    try:
        texts = load_prompt_set(args.prompt_set, limit)
        target = load_model(args.model, dtype=dtype_from_name(args.dtype))
    except UserError as e:
        print(f"bench_mesh: error: {e}", file=sys.stderr)
        return 2
    prompts = [encode_prompt(target.tokenizer, t) for t in texts]
    fake = args.fake_devices is not None
    print(f"bench_mesh: {target.source} ({target.weights.embed.dtype}) on {len(jax.devices())} "
          f"{jax.default_backend()} device(s){' (fake)' if fake else ''}; meshes {ONE_DEVICE}, {', '.join(meshes)}; "
          f"methods {', '.join(names)}; batch sizes {args.batch_sizes}; {len(prompts)} {args.prompt_set} prompts; "
          f"{args.max_new_tokens} new tokens; greedy", file=sys.stderr)
    if fake:
        print(f"note: {FAKE_DEVICE_NOTE}.", file=sys.stderr)

    rows, skipped = [], []

    def skip(method: str, mesh: str, batch, reason: str) -> None:
        skipped.append({"method": method, "mesh": mesh, "batch_size": batch, "reason": reason})
        tqdm.write(f"skipped {method} on {mesh}" + (f" at batch {batch}" if batch else "") + f": {reason}",
                   file=sys.stderr)

    configs = [(None, spec) for spec in names] + [(mesh, spec) for mesh in meshes for spec in names]
    bar = tqdm(total=len(configs) * len(args.batch_sizes), desc="bench_mesh", unit="run", file=sys.stderr)
    for mesh_text, spec in configs:
        name, _, drafter = spec.partition("=")
        shown_mesh = mesh_text or ONE_DEVICE
        try:
            method = build_method(name, target, MethodOptions(mesh=mesh_text, drafter=drafter or None))
        except UserError as e:
            skip(spec, shown_mesh, None, str(e))
            bar.update(len(args.batch_sizes))
            continue
        shown_mesh = mesh_label(method.mesh)
        for batch_size in args.batch_sizes:
            bar.set_postfix_str(f"{spec} | {shown_mesh} | B={batch_size}")
            try:
                if method.mesh is not None and "data" in method.mesh.axis_names:
                    check_divisible(target.config, batch_size, method.mesh)
                run = _time(method, _batches(prompts, batch_size), args.max_new_tokens)
            except UserError as e:
                skip(spec, shown_mesh, batch_size, str(e))
                bar.update()
                continue
            rows.append({"label": spec, "method": name, "mesh": shown_mesh, "mesh_argument": mesh_text,
                         "mesh_shape": None if method.mesh is None else dict(method.mesh.shape),
                         "batch_size": batch_size, "num_rows": len(run["token_ids"]),
                         **run})
            bar.update()
        del method
        jax.clear_caches()  # one set of compiled programs per configuration: keep the memory maps bounded
    bar.close()

    for r in rows:  # ratios and token equality against the same batch size's baselines
        ar = next((b for b in rows if b["method"] == "autoregressive" and b["mesh"] == r["mesh"]
                   and b["batch_size"] == r["batch_size"]), None)
        one = next((b for b in rows if b["label"] == r["label"] and b["mesh"] == ONE_DEVICE
                    and b["batch_size"] == r["batch_size"]), None)
        tps = r["tokens_per_second"]
        r["ratio_to_autoregressive"] = tps / ar["tokens_per_second"] if ar and tps and ar["tokens_per_second"] else None
        r["ratio_to_one_device"] = tps / one["tokens_per_second"] if one and tps and one["tokens_per_second"] else None
        r["same_tokens_as_one_device"] = None if one is None or one is r else r["token_ids"] == one["token_ids"]

    table = format_table(rows)
    os.makedirs(args.out, exist_ok=True)
    record = {
        "command": shlex.join(["python", "benchmarks/bench_mesh.py", *argv]),
        "model": args.model, "source": target.source, "dtype": str(target.weights.embed.dtype),
        "backend": jax.default_backend(), "num_devices": len(jax.devices()), "fake_devices": args.fake_devices,
        "jax_version": jax.__version__, "cpu_count": os.cpu_count(), "meshes": meshes,
        "prompt_set": args.prompt_set, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "batch_sizes": args.batch_sizes, "seconds": time.perf_counter() - started,
        "note": ("greedy; compile excluded (each compiled shape runs once untimed first, warmup_seconds); "
                 "tokens_per_second = new tokens / seconds of the timed runs, prefill included"
                 + (f"; {FAKE_DEVICE_NOTE}" if fake else "")),
        "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
        "skipped": skipped,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(record, f, indent=2)
    written = [os.path.join(args.out, "results.json")]
    if rows:
        plot(rows, os.path.join(args.out, "throughput_vs_batch.png"))
        written.append(os.path.join(args.out, "throughput_vs_batch.png"))
    print(table)
    print("\ntokens/s = new tokens / seconds of the timed runs (prefill included, compile excluded); tau = tokens per "
          "verification round; vs AR = tokens/s over autoregressive's on the same mesh and batch; vs 1 device = over "
          "the same method on one device; same tokens = greedy tokens equal one device's."
          + (f"\nNote: {FAKE_DEVICE_NOTE}." if fake else ""))
    for s in skipped:
        print(f"Skipped {s['method']} on {s['mesh']}" + (f" at batch {s['batch_size']}" if s["batch_size"] else "")
              + f": {s['reason']}")
    print(f"Wrote {', '.join(written)} ({record['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
