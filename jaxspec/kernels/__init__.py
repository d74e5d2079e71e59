"""CPU kernels XLA lacks: the product of a weight matrix with a few columns, reading the weight once (below);
attention over each row's cache up to its length (`cache_attention`); the greedy token from a bfloat16 copy of
the LM head (`greedy_head`), also with noise added to the logits (a sample by the Gumbel-max rule).

On CPU a decoding step multiplies every weight matrix with one column, which XLA runs as a matrix-vector loop at
about the memory bandwidth; a verification of 2-16 tokens multiplies it with 2-16 columns, which XLA:CPU hands to a
library matrix product that costs 1.6-1.9 such streams on the 2-core EPYC (docs/cpu-performance.md). The kernel in
`small_product.cc` streams each row of the weight once and multiplies it with all the columns: on that machine
2 / 4 columns of SmolLM2's MLPs cost 1.2 / 1.35 single-column products instead of 1.8 / 1.9. Where the CPU has
AVX-512 (the 2-core Xeon) a 16-wide loop runs instead, and there it streams even one column faster than XLA's
matrix-vector loop: a decoding step 26-28 -> 22 ms. The same loops take a bfloat16 matrix (`bf16_product`), widened
exactly in registers: an EAGLE head stored in bfloat16 drafts from half the bytes, with the same products.

It is built on first use with the system's C++ compiler (g++, AVX2 and FMA; about 10 seconds) into
`jaxspec.budget.cache_folder()`, and called through XLA's FFI. Whether it pays depends on the machine, so the
column counts at which it runs are measured once per machine against XLA's own product (about 30 seconds) and
cached beside it: 2-16 columns on a chain of products, one column on whole decoding steps (`measure_columns`).
$JAXSPEC_SMALL_PRODUCT overrides that: "off" (XLA's products only) or a column count (at most 16).
Where the kernel cannot be built (no compiler, another CPU) XLA's product runs, and a warning says why once.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

SOURCES = tuple(os.path.join(os.path.dirname(__file__), name)
                for name in ("small_product.cc", "cache_attention.cc", "greedy_head.cc"))
HEADERS = (os.path.join(os.path.dirname(__file__), "cpu_common.h"),)  # included by the sources, part of the digest
MAX_COLUMNS = 16  # kMaxColumns in small_product.cc
ENV = "JAXSPEC_SMALL_PRODUCT"  # "off", a column count, or unset / "auto": measured once per machine
ATTENTION_ENV = "JAXSPEC_CACHE_ATTENTION"  # "off": XLA's attention over the cache; unset / "on": the kernel
TARGET_NAME = "jaxspec_small_product"
ATTENTION_TARGET_NAME = "jaxspec_cache_attention"
GREEDY_HEAD_TARGET_NAME = "jaxspec_greedy_head"
SAMPLED_HEAD_TARGET_NAME = "jaxspec_sampled_head"
BF16_PRODUCT_TARGET_NAME = "jaxspec_bf16_product"
MEASUREMENT = "tiles1"  # how `measure_columns` decides (part of its cache file's name: a new way measures again)
# The column counts at which the kernel runs its 3-row tiles where they are not measured ($JAXSPEC_SMALL_PRODUCT
# given): from 9 on, where they won on both 2-core machines (`tiled_columns`)
DEFAULT_TILED = frozenset(range(9, MAX_COLUMNS + 1))
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")


def source_digest() -> str:
    """16 hex digits naming the kernels' sources, their compile flags and the jaxlib whose FFI headers they use."""
    import jaxlib

    digest = hashlib.sha256(f"{jaxlib.__version__} {' '.join(COMPILE_FLAGS)}".encode())
    for source in (*SOURCES, *HEADERS):
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _build(path: str) -> None:
    """Compiles the kernels' sources into one shared library `path` (written under another name, then renamed, so
    processes building at the same time never load a half-written file)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        command = [compiler, *COMPILE_FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", partial]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@functools.cache
def load_kernel() -> str | None:
    """Builds (once per machine) and registers the kernels with XLA; returns None when they are available, else why
    not."""
    from jaxspec.budget import cache_folder

    if not _cpu_has_avx2_fma():
        return f"this CPU ({platform.machine()}) lacks AVX2 and FMA"
    path = os.path.join(cache_folder(), "kernels", f"kernels-{source_digest()}.so")
    try:
        if not os.path.exists(path):
            print("jaxspec: building the CPU kernels for few-token products and cache attention (once per machine, "
                  "about 15 s) ...", file=sys.stderr)
            _build(path)
        library = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.JaxspecSmallProduct), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET_NAME, jax.ffi.pycapsule(library.JaxspecCacheAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(GREEDY_HEAD_TARGET_NAME, jax.ffi.pycapsule(library.JaxspecGreedyHead),
                                    platform="cpu")
        jax.ffi.register_ffi_target(SAMPLED_HEAD_TARGET_NAME, jax.ffi.pycapsule(library.JaxspecSampledHead),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BF16_PRODUCT_TARGET_NAME, jax.ffi.pycapsule(library.JaxspecBf16Product),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"it could not be built or loaded: {e}"
    return None


def kernel_product(w: jax.Array, x: jax.Array, tiles: bool = False) -> jax.Array:
    """w @ x by the kernel (which must be loaded): w f32[out, in], x f32[in, N] with 1 <= N <= 16 -> f32[out, N].
    tiles: by its 3-row tiles (on AVX-512 CPUs; elsewhere the one-row loop runs either way) instead of its one-row
    loop: the same sums in another order, the faster one per column count measured once per machine
    (`tiled_columns`)."""
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_NAME, out, vmap_method="sequential")(w, x, tiles=np.int32(tiles))


def bf16_product(w: jax.Array, x: jax.Array, tiles: bool = False) -> jax.Array:
    """w @ x by the kernel (which must be loaded) from a bfloat16 matrix: w bf16[out, in], x f32[in, N] with
    1 <= N <= 16 -> f32[out, N], bit for bit `kernel_product(w.astype(float32), x, tiles)` (the weights are widened
    exactly in registers and summed in the same order), reading half the bytes."""
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(BF16_PRODUCT_TARGET_NAME, out, vmap_method="sequential")(w, x, tiles=np.int32(tiles))


def greedy_head(screen: jax.Array, rows: jax.Array, h: jax.Array, error: jax.Array,
                noise: jax.Array | None = None) -> jax.Array:
    """The argmax token of each position's logits rows @ h[n] (plus noise[n] when given), by the kernel (which must be
    loaded), reading the bfloat16 `screen` of the rows and only a few float32 rows (greedy_head.cc;
    `jaxspec.model.greedy_tokens`). screen: bf16[V, d]; rows: f32[V, d]; h: f32[N, d] final-normed, 1 <= N <= 16;
    error: f32[]; noise: f32[N, V] or None -> int32[N]."""
    out = jax.ShapeDtypeStruct((h.shape[0],), jnp.int32)
    if noise is None:
        return jax.ffi.ffi_call(GREEDY_HEAD_TARGET_NAME, out, vmap_method="sequential")(screen, rows, h, error)
    return jax.ffi.ffi_call(SAMPLED_HEAD_TARGET_NAME, out, vmap_method="sequential")(screen, rows, h, error, noise)


def _time_chains(matrices, columns: int, repeats: int = 7) -> tuple[float, float, float]:
    """Best seconds of one jitted pass over `matrices` (each [out, in], alternating shapes) with `columns` columns, by
    XLA's product, by the kernel's one-row loop and by its tiles, timed in turn (a shared host drifts between
    separate timings)."""
    x = jnp.ones((matrices[0].shape[1], columns), jnp.float32) * 1e-3  # [in, N]

    def chain(product):
        def run(ws, x):
            for w_up, w_down in zip(ws[::2], ws[1::2]):
                x = x + product(w_down, jnp.tanh(product(w_up, x)))  # [in, N]
            return x
        return jax.jit(run)

    runs = [chain(jnp.matmul), chain(kernel_product), chain(functools.partial(kernel_product, tiles=True))]
    for run in runs:
        jax.block_until_ready(run(matrices, x))
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            jax.block_until_ready(run(matrices, x))
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1], best[2]


# The model whose decoding step `_time_decoding_steps` times: SmolLM2-135M's shape (the default target), random weights
STEP_PROBE_SHAPE = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                        num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
_tracing = threading.local()  # .columns: the column counts `feature_major_product` serves while a probe traces


def _served_columns() -> frozenset[int]:
    """The column counts the kernel serves in the forward being traced: `small_product_columns()`, except while
    `_time_decoding_steps` traces one of its two variants in its own thread."""
    columns = getattr(_tracing, "columns", None)
    return small_product_columns() if columns is None else columns


def _time_decoding_steps(steps: int = 17, repeats: int = 3) -> tuple[float, float]:
    """Seconds of a batch-1 decoding step (every product one column) with XLA's product at one column and with the
    kernel's (2-16 columns by the kernel in both), timed in turn in this process (`jaxspec.generate.step_seconds`),
    on a model of `STEP_PROBE_SHAPE` (random weights, the per-layer layout).

    One column is decided on whole steps, not on a chain of products: on the 2-core Xeon the chain put the two
    products level (XLA ahead by 1-4% on 85-708 MB of matrices) while a decoding step ran 23.1 ms with the kernel
    against 25.6 ms with XLA's product (SmolLM2-135M; 42.6-45.7 against 37.8-39.5 tok/s), and the near tie of the
    chain once gave XLA the one column on this machine."""
    from jaxspec.config import ModelConfig
    from jaxspec.generate import generate_tokens, step_seconds
    from jaxspec.model import feature_major_layers, init_weights

    cfg = ModelConfig(**STEP_PROBE_SHAPE)
    weights = feature_major_layers(init_weights(cfg, jax.random.key(0)))
    tokens = jnp.zeros((1, 16), jnp.int32)  # [1, 16]
    lengths = jnp.full((1,), 8, jnp.int32)  # [1]: an 8-token prompt
    variants = {"xla": frozenset(range(2, MAX_COLUMNS + 1)), "kernel": frozenset(range(1, MAX_COLUMNS + 1))}

    def decoder(columns):  # a function of its own per variant, so that each traces (and caches) its own forward
        def decode(weights, tokens, lengths, new_tokens):
            return generate_tokens.__wrapped__(weights, cfg, tokens, lengths, jax.random.key(0),
                                               max_new_tokens=new_tokens, cache_size=64)
        jitted = jax.jit(decode, static_argnums=3)

        def run(new_tokens: int) -> float:
            _tracing.columns = columns
            try:
                start = time.perf_counter()
                jax.block_until_ready(jitted(weights, tokens, lengths, new_tokens))
                return time.perf_counter() - start
            finally:
                _tracing.columns = None
        return run

    step = step_seconds({name: decoder(columns) for name, columns in variants.items()}, steps, repeats)
    return step["xla"], step["kernel"]


def measure_columns(d: int = 576, f: int = 1536, layers: int = 12) -> dict:
    """Times XLA's product and the kernel for 1..16 columns: 2-16 on `layers` pairs of [f, d] / [d, f] matrices (85
    MB at the defaults: more than most CPUs' caches, as a model's weights are), by the kernel's one-row loop and by
    its 3-row tiles, one column on whole decoding steps (`_time_decoding_steps`). Returns {"columns": the counts at
    which the kernel (the faster of its two loops) was faster than XLA, "tiled": those of them at which its tiles were
    the faster loop, "seconds": {N: {"xla": s, "kernel": s, "tiled": s}}} (at one column the seconds of a step, no
    tiles). (XLA's library product is uneven: on the 2-core EPYC it was as fast as the kernel at 8 and 16 columns and
    2.5x slower at 9-15. The tiles' gain depends on the CPU: on the 2-core Xeon the one-row loop was the faster below 8
    columns; on the 2-core EPYC the tiles were 15-35% faster from 5 columns on.)"""
    rng = np.random.default_rng(0)
    matrices = []
    for _ in range(layers):
        matrices.append(jnp.asarray(rng.standard_normal((f, d), np.float32) * 0.02))  # [f, d]
        matrices.append(jnp.asarray(rng.standard_normal((d, f), np.float32) * 0.02))  # [d, f]
    seconds, columns, tiled = {}, [], []
    for n in range(1, MAX_COLUMNS + 1):
        if n == 1:
            seconds["1"] = dict(zip(("xla", "kernel"), _time_decoding_steps()))
        else:
            seconds[str(n)] = dict(zip(("xla", "kernel", "tiled"), _time_chains(matrices, n)))
        times = seconds[str(n)]
        if min(times["kernel"], times.get("tiled", math.inf)) < times["xla"]:
            columns.append(n)
            if times.get("tiled", math.inf) < times["kernel"]:
                tiled.append(n)
    return {"columns": columns, "tiled": tiled, "seconds": seconds}


def _setting() -> str:
    """$JAXSPEC_SMALL_PRODUCT, normalised: "off" for any of its spellings, else as given ("auto" when unset)."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    return "off" if setting in ("off", "0", "no", "false") else setting


def kernels_on() -> bool:
    """Whether jaxspec's CPU kernels can run in this process: they build and load here, and $JAXSPEC_SMALL_PRODUCT is
    not "off" (which turns them all off). Measures nothing (`small_product_columns` says where the product runs)."""
    return _setting() != "off" and load_kernel() is None


@functools.cache
def small_product_columns() -> frozenset[int]:
    """The column counts at which `feature_major_product` runs the kernel in this process: from
    $JAXSPEC_SMALL_PRODUCT when set ("off": none, N: 1 to N), else measured once per machine (`measure_columns`) and
    cached as JSON in `cache_folder()`."""
    from jaxspec.errors import UserError

    setting = _setting()
    if setting == "off":
        return frozenset()
    if setting != "auto":
        columns = int(setting) if setting.isdigit() else -1
        if not 1 <= columns <= MAX_COLUMNS:
            raise UserError(f"${ENV} must be 'auto' (measure once per machine), 'off' (XLA's products only) or a "
                            f"column count from 1 to {MAX_COLUMNS}; got {setting!r}.")
    why_not = load_kernel()
    if why_not is not None:
        warnings.warn(f"jaxspec: XLA's own products verify few tokens on this CPU: the small-product kernel is off "
                      f"because {why_not}", stacklevel=2)
        return frozenset()
    if setting != "auto":
        return frozenset(range(1, columns + 1))
    path = _measurement_path()
    try:
        with open(path) as f:
            return frozenset(int(n) for n in json.load(f)["columns"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print("jaxspec: timing the few-token kernel against XLA's product (once per machine, about 30 s) ...",
          file=sys.stderr)
    # the first call usually comes while a forward is being traced, where JAX would stage the timing's own arrays
    # and programs into that trace instead of running them: a thread has a trace state of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        measured = pool.submit(measure_columns).result()
    from jaxspec.data import write_json

    write_json(path, measured)
    return frozenset(measured["columns"])


def _measurement_path() -> str:
    """The JSON file of this machine's `measure_columns` (in `jaxspec.budget.cache_folder()`)."""
    from jaxspec.budget import cache_folder

    return os.path.join(cache_folder(), f"small-product-{MEASUREMENT}-{source_digest()}.json")


@functools.cache
def tiled_columns() -> frozenset[int]:
    """The column counts at which the kernel runs its 3-row tiles rather than its one-row loop (where the CPU has
    AVX-512): measured with the columns (`measure_columns`: the faster of the two per column count), DEFAULT_TILED
    where $JAXSPEC_SMALL_PRODUCT gives the columns (or the measurement has none)."""
    columns = small_product_columns()
    if _setting() == "auto" and columns:
        try:
            with open(_measurement_path()) as f:
                return frozenset(int(n) for n in json.load(f)["tiled"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return DEFAULT_TILED & columns


def _served_tiles(columns: int) -> bool:
    """Whether the kernel's product over `columns` columns runs its tiles in the forward being traced (never one
    column; while `_time_decoding_steps` traces, whose steps are one column, DEFAULT_TILED, not the measurement in
    progress)."""
    if columns == 1:
        return False
    return columns in (DEFAULT_TILED if getattr(_tracing, "columns", None) is not None else tiled_columns())


def feature_major_product(w: jax.Array, x: jax.Array) -> jax.Array:
    """w @ x for a feature-major layer on CPU: w [out, in], x [in, N] -> [out, N]. By the kernel for float32 and N
    in `small_product_columns()` (measured: on the Xeon one column too, where the AVX-512 loop beats XLA's
    matrix-vector loop), by XLA otherwise. A bfloat16 w (an EAGLE head whose weights are bfloat16 values,
    `jaxspec.drafters.eagle.feature_major_head`) with float32 x gives float32, exactly what its float32 copy gives: by
    `bf16_product` where the copy would run the kernel, else from w widened to float32 by XLA."""
    n = x.shape[1]
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        if 1 <= n <= MAX_COLUMNS and jax.default_backend() == "cpu" and n in _served_columns():
            return bf16_product(w, x, _served_tiles(n))
        return w.astype(jnp.float32) @ x
    if (1 <= n <= MAX_COLUMNS and w.dtype == jnp.float32 and x.dtype == jnp.float32
            and jax.default_backend() == "cpu" and n in _served_columns()):
        return kernel_product(w, x, _served_tiles(n))
    return w @ x


@functools.cache
def cache_attention_enabled() -> bool:
    """Whether `cache_attention` runs the kernel in this process: unless $JAXSPEC_CACHE_ATTENTION is "off", wherever
    the kernels build (else XLA's attention, with the warning `small_product_columns` gives)."""
    from jaxspec.errors import UserError

    setting = os.environ.get(ATTENTION_ENV, "on").strip().lower()
    if setting not in ("on", "off"):
        raise UserError(f"${ATTENTION_ENV} must be 'on' (the CPU kernel for attention over the cache, the default) or "
                        f"'off' (XLA's attention); got {setting!r}.")
    if setting == "off" or jax.default_backend() != "cpu":
        return False
    why_not = load_kernel()
    if why_not is not None:
        warnings.warn(f"jaxspec: XLA's attention runs over the cache on this CPU: the kernels are off because "
                      f"{why_not}", stacklevel=2)
        return False
    return True


def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, lengths: jax.Array, new_k: jax.Array,
                    new_v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention over each row's first `lengths` cache slots plus the new tokens, by the kernel (which must be
    loaded). q: f32[B, T, K, G, h], already scaled; cache_k, cache_v: f32[B, K, S, h]; lengths: int32[B];
    new_k, new_v: f32[B, T, K, h]; mask: bool[B, T, T] (query t sees new token u). Returns f32[B, T, K, G, h]."""
    b, t, k, _, h = q.shape
    if (cache_k.shape != cache_v.shape or cache_k.shape[:2] != (b, k) or cache_k.shape[3] != h
            or new_k.shape != (b, t, k, h) or new_v.shape != (b, t, k, h) or lengths.shape != (b,)):
        raise ValueError(f"cache_attention: q {q.shape}, cache {cache_k.shape} / {cache_v.shape}, new {new_k.shape} / "
                         f"{new_v.shape}, lengths {lengths.shape} do not fit [B, T, K, G, h] / [B, K, S, h] / "
                         "[B, T, K, h] / [B]")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGET_NAME, out, vmap_method="sequential")(
        q, cache_k, cache_v, lengths.astype(jnp.int32), new_k, new_v,
        jnp.broadcast_to(mask.astype(jnp.bool_), (b, t, t)))
