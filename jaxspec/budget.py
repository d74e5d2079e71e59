"""A tree budget that follows load: `--budget auto` picks how many nodes B a tree drafter verifies per round.

Cost model: one target forward over a chain of T + 1 tokens (the root and T drafted nodes) on top of a cache of
`context` committed tokens is timed on this device for a small grid of batch sizes and token counts (the median of a
few calls after one compiling call). `CostModel.verify_seconds` interpolates that grid piecewise-linearly in
(log batch, log tokens, log seconds). The grid is measured once per device, weights dtype and target (its
fingerprint) and cached as JSON in $JAXSPEC_CACHE_DIR (default ~/.cache/jaxspec), file
`cost-model-{device}-{fingerprint}-{code}.json`, where code names the source of the forward that was timed
(`forward_code_digest`: a changed forward, or another JAX, is timed afresh instead of being chosen by a stale file's
seconds); delete that file, or pass another path, to measure again. The grid may
be sparse: a method that needs other shapes than the cached ones measures only the missing cells (each compiles a
program, so re-measuring a whole union grid would cost minutes) and the file keeps them all.

Choice rule: a round at budget B accepts tau(B) tokens per row on average and costs one verification forward of
B + 1 tokens per row (plus drafting, if the caller knows its cost), so throughput(B) = batch * tau(B) / seconds(B).
The budget with the highest throughput wins (ties go to the smaller budget). At batch 1 the forward is bound by
reading the weights, so extra nodes are nearly free and a large budget wins; at large batches it is bound by
compute, every node costs time and a small budget wins.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxspec.cache import KVCache, init_cache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.generate import decode_step
from jaxspec.model import LAYERS_ENV, Weights, execution_weights, greedy_tokens, output_matrix
from jaxspec.sampling import SamplingConfig, gumbel_noise
from jaxspec.tree import DraftTree, chain_parents
from jaxspec.verification import verify_forward

DEFAULT_BATCH_SIZES = (1, 4, 16)
DEFAULT_TOKEN_COUNTS = (1, 9, 17, 33, 65, 129)
DEFAULT_CONTEXT = 256
DEFAULT_BUDGETS = (8, 16, 32, 64, 128)
# A placeholder, not a measurement: tau(B) = 1 + 0.3 * log2(1 + B) gives about 2 tokens per round at B = 8 and 3 at
# B = 128, the shape (not the level) of what tree drafters report. Pass measured taus to `choose_budget` instead.
DEFAULT_TAU_GAIN = 0.3


@dataclasses.dataclass
class CostModel:
    """Seconds of one verification forward on one device, on a grid of batch sizes x tokens per row.

    device: where it was measured (platform, device kind, weights dtype); model: the target's fingerprint;
    batch_sizes: ascending; token_counts: tokens per row of one forward (T + 1), ascending, normally starting at 1;
    seconds: [len(batch_sizes)][len(token_counts)], None where that cell was not measured (every batch size has at
    least one measured cell); context: committed tokens in the cache while timing (None when unknown, e.g. a
    hand-made model).
    """

    device: str
    model: str
    batch_sizes: list[int]
    token_counts: list[int]
    seconds: list[list[float | None]]  # [len(batch_sizes), len(token_counts)]
    context: int | None = None

    def __post_init__(self):
        self.batch_sizes = [int(b) for b in self.batch_sizes]
        self.token_counts = [int(t) for t in self.token_counts]
        self.seconds = [[None if s is None else float(s) for s in row] for row in self.seconds]
        for name, grid in (("batch_sizes", self.batch_sizes), ("token_counts", self.token_counts)):
            if not grid or grid[0] < 1 or any(a >= b for a, b in zip(grid, grid[1:])):
                raise UserError(f"A cost model's {name} must be positive and strictly ascending; got {grid}.")
        shape = (len(self.batch_sizes), len(self.token_counts))
        if len(self.seconds) != shape[0] or any(len(row) != shape[1] for row in self.seconds):
            raise UserError(f"A cost model's seconds must be a {shape[0]} x {shape[1]} grid (batch sizes x tokens).")
        if not all(s is None or (math.isfinite(s) and s > 0) for row in self.seconds for s in row):
            raise UserError("A cost model's seconds must all be positive and finite (or null: not measured).")
        if any(all(s is None for s in row) for row in self.seconds):
            raise UserError("Every batch size of a cost model needs at least one measured token count.")

    def verify_seconds(self, batch: int, tokens: int) -> float:
        """Seconds of one verification forward of `batch` rows x `tokens` tokens per row.

        Piecewise-linear in (log batch, log tokens) -> log seconds: each batch size's measured cells are
        interpolated at `tokens`, then those values across batch sizes. Exact at measured cells, a power law between
        neighbours. Below the first batch size or measured token count the edge value is kept; past the last one the
        last segment's power law continues (never decreasing, so noise cannot make large shapes cheap).
        """
        if batch < 1 or tokens < 1:
            raise UserError(f"verify_seconds needs batch >= 1 and tokens >= 1; got batch={batch}, tokens={tokens}.")
        per_batch = []  # log seconds at `tokens`, one per batch size
        for row in self.seconds:
            cells = [(math.log(t), math.log(s)) for t, s in zip(self.token_counts, row) if s is not None]
            per_batch.append(_interpolate([x for x, _ in cells], [y for _, y in cells], math.log(tokens)))
        log_batches = [math.log(b) for b in self.batch_sizes]
        return math.exp(_interpolate(log_batches, per_batch, math.log(batch)))

    def measured(self) -> set[tuple[int, int]]:
        """The (batch size, token count) cells that hold a measurement."""
        return {(b, t) for b, row in zip(self.batch_sizes, self.seconds)
                for t, s in zip(self.token_counts, row) if s is not None}

    def covers(self, batch_sizes: Sequence[int], token_counts: Sequence[int]) -> bool:
        """Whether every requested (batch size, token count) cell was measured."""
        return {(int(b), int(t)) for b in batch_sizes for t in token_counts} <= self.measured()

    def merged(self, other: CostModel) -> CostModel:
        """The cells of both models on the union grid (`other`'s where both measured one); same device and model."""
        if (other.device, other.model, other.context) != (self.device, self.model, self.context):
            raise UserError("Only cost models of one device, target and context can be merged.")
        cells = {(b, t): s for m in (self, other) for b, row in zip(m.batch_sizes, m.seconds)
                 for t, s in zip(m.token_counts, row) if s is not None}
        batch_sizes = sorted(set(self.batch_sizes) | set(other.batch_sizes))
        token_counts = sorted(set(self.token_counts) | set(other.token_counts))
        return dataclasses.replace(self, batch_sizes=batch_sizes, token_counts=token_counts,
                                   seconds=[[cells.get((b, t)) for t in token_counts] for b in batch_sizes])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Parses `to_json`'s output; raises ValueError (json or UserError) when it is malformed."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise UserError("A cost model file must hold a JSON object.")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data and n != "context"]
        if missing:
            raise UserError(f"A cost model file lacks {', '.join(missing)}.")
        return cls(**{n: data[n] for n in names if n in data})

    def save(self, path: str) -> None:
        """Writes the JSON to `path` (creating folders), through a temporary file so a crash leaves no half file."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            return cls.from_json(f.read())


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys), xs ascending: held flat below xs[0], the last segment continued (with
    a slope of at least 0) past xs[-1]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    i = int(np.searchsorted(xs, x, side="right")) - 1  # xs[i] <= x < xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (x - xs[i])


# ---------------------------------------------------------------------------------------------- measuring


def device_name(dtype=None, layout: bool = True) -> str:
    """The first device as platform-kind[-dtype], e.g. "gpu-NVIDIA H200-bfloat16" (dtype: the weights'); on CPU
    with `layout`, "-unstacked" added under JAXSPEC_LAYERS=unstacked (`jaxspec.model.execution_weights`)."""
    device = jax.devices()[0]
    name = f"{device.platform}-{device.device_kind}"
    if layout and device.platform == "cpu" and os.environ.get(LAYERS_ENV) == "unstacked":
        name += "-unstacked"
    return name if dtype is None else f"{name}-{jnp.dtype(dtype).name}"


def _verification(weights: Weights, cfg: ModelConfig, cache: KVCache, root: jax.Array, tree: DraftTree,
                  sampled: bool = False):
    """(the target's argmax at the root and every node, int32[B, T+1], cache): a verification at temperature 0 as the
    decoding loop runs it (`greedy_tokens`: on the CPU layout from the LM head's bfloat16 screen), cache updated in
    place; with no drafted node (T = 0) the autoregressive decoding step instead (what plain decoding runs).

    sampled: as a round at a temperature draws its tokens instead: Gumbel noise [B, T+1, V] made and added to the
    logits of every position (`jaxspec.sampling.gumbel_noise`; the draw by the Gumbel-max rule of the loops, also of
    plain decoding's step). That costs per verified row (about 0.3 ms a row for SmolLM2 on 2 CPU cores), which a
    greedy cost model leaves out."""
    noise = None
    if sampled:
        vocab = output_matrix(weights).shape[0]
        noise = gumbel_noise(jax.random.key(0), (root.shape[0], tree.tokens.shape[1] + 1, vocab),
                             SamplingConfig(temperature=1.0))  # [B, T+1, V]
    if tree.tokens.shape[1] == 0:
        kept = jnp.zeros_like(root, jnp.bool_)  # lengths stay
        best, cache = decode_step(weights, cfg, root, cache, kept, greedy=True,
                                  noise=None if noise is None else noise[:, 0])
        return best[:, None], cache
    out = verify_forward(weights, cfg, cache, root, tree, compute_logits=False)
    return greedy_tokens(weights, cfg, out.last_hidden, noise), out.cache


# The cache is donated, as in the decoding loop: without donation XLA copies the whole cache every call.
_verification_jit = jax.jit(_verification, static_argnames=("cfg", "sampled"), donate_argnames=("cache",))


def measure_cost_model(
    target,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
    context: int = DEFAULT_CONTEXT,
    repeats: int = 9,
    progress: bool = True,
    skip: frozenset[tuple[int, int]] = frozenset(),
    sampled: bool = False,
) -> CostModel:
    """Times the target's verification forward on this device for every batch size x token count.

    Each shape runs a chain tree of T = tokens - 1 nodes over a cache holding `context` tokens per row (one token:
    the autoregressive decoding step), at temperature 0 (the argmaxes by `greedy_tokens`), with the weights and the
    cache laid out as the decoding loops lay them out (`execution_weights`: per-layer buffers under
    JAXSPEC_LAYERS=unstacked); one call per shape compiles (not timed),
    then the shapes of a batch size run in turn, one untimed round and `repeats` timed ones, and each shape's
    median is kept: a host whose speed drifts while it measures moves every shape alike, so the differences between
    token counts (what `--budget auto` weighs) stay true (timed shape after shape, with the median of 3, a drift of
    a few percent once made a third verified token look nearly free and flipped the choice).

    Args:
        target: a `jaxspec.loading.LoadedModel`.
        batch_sizes: rows per forward. token_counts: tokens per row (T + 1); 1 (plain decoding) is always added.
        context: committed tokens in the cache, the attention length the forward reads.
        repeats: timed calls per shape.
        progress: Show a tqdm bar on stderr.
        skip: (batch size, token count) cells not to measure (already known): None in the result.
        sampled: time the forwards as a round at a temperature runs them, drawing every position's token with
            Gumbel noise (`_verification`); the device name then ends in "-sampled" (`cost_device`).
    """
    token_counts = sorted(set(int(t) for t in token_counts) | {1})
    batch_sizes = sorted(b for b in set(int(b) for b in batch_sizes) if any((b, t) not in skip for t in token_counts))
    if not batch_sizes or batch_sizes[0] < 1 or token_counts[0] < 1:
        raise UserError(f"Batch sizes and token counts must be positive; got {batch_sizes} and {token_counts}.")
    if context < 0 or repeats < 1:
        raise UserError(f"The context must be >= 0 and repeats >= 1; got context={context}, repeats={repeats}.")
    weights, cfg = execution_weights(target.weights), target.config  # as the generation functions run them
    seconds = []  # [len(batch_sizes), len(token_counts)]
    todo = sum((b, t) not in skip for b in batch_sizes for t in token_counts)
    with tqdm(total=todo, desc="cost model", unit="shape", disable=not progress,
              file=sys.stderr) as bar:
        for b in batch_sizes:
            cache = init_cache(cfg, b, context + max(token_counts) + 1, weights.embed.dtype,
                               per_layer=isinstance(weights.layers, tuple))  # as the decoding loops make it
            cache = dataclasses.replace(cache, lengths=jnp.full((b,), context, jnp.int32))
            root = jnp.zeros((b,), jnp.int32)  # [B]
            trees = {}  # token count -> its chain tree, compiled
            for tokens in token_counts:
                if (b, tokens) in skip:
                    continue
                num_nodes = tokens - 1
                trees[tokens] = DraftTree(
                    tokens=jnp.zeros((b, num_nodes), jnp.int32),  # [B, T]
                    parents=jnp.broadcast_to(jnp.asarray(chain_parents(num_nodes)), (b, num_nodes)),  # [B, T]
                    valid=jnp.ones((b, num_nodes), jnp.bool_),  # [B, T]
                )
                best, cache = _verification_jit(weights, cfg, cache, root, trees[tokens], sampled)  # compiles
                jax.block_until_ready(best)
                bar.update(1)
            times = {tokens: [] for tokens in trees}
            for repeat in range(repeats + 1):  # the shapes in turn, so that a drifting host moves them alike
                for tokens, tree in trees.items():
                    start = time.perf_counter()
                    best, cache = _verification_jit(weights, cfg, cache, root, tree, sampled)
                    jax.block_until_ready(best)
                    if repeat > 0:  # the first round warms up (it ran slow right after compiling)
                        times[tokens].append(time.perf_counter() - start)
            seconds.append([statistics.median(times[t]) if t in times else None for t in token_counts])
            del cache
    return CostModel(
        device=cost_device(target, sampled),
        model=target.fingerprint(),
        batch_sizes=batch_sizes,
        token_counts=token_counts,
        seconds=seconds,
        context=context,
    )


def cache_folder() -> str:
    """jaxspec's cache folder: $JAXSPEC_CACHE_DIR, default ~/.cache/jaxspec (cost models, draft ranks, and the
    compiled XLA programs of `enable_compilation_cache`)."""
    return os.environ.get("JAXSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxspec")


def enable_compilation_cache() -> str | None:
    """Keeps compiled XLA programs on disk (JAX's persistent compilation cache) in `cache_folder()/xla`, so that a
    second run of the same command skips most compilation (the unrolled per-layer loops take tens of seconds to
    compile on CPU). Left alone when the user configured a folder already ($JAX_COMPILATION_CACHE_DIR or
    `jax.config`) or set JAXSPEC_COMPILATION_CACHE=0. Returns the folder in use, None when disabled. Called by the
    command line; library users may call it, or set JAX's own option."""
    if os.environ.get("JAXSPEC_COMPILATION_CACHE", "1") == "0":
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = os.path.join(cache_folder(), "xla")
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


# what a timed forward runs, and the timing itself (this module)
FORWARD_MODULES = ("model", "cache", "verification", "tree", "gated_delta", "sharding", "generate", "budget", "kernels")


@functools.lru_cache(maxsize=1)
def forward_code_digest() -> str:
    """16 hex digits naming the code a cost model times: the source of jaxspec's forward modules (FORWARD_MODULES),
    the CPU kernel's source and the column counts it serves here, and the JAX and jaxlib versions. A cost model
    measured before the forward changed (a faster layout, a fix) would otherwise keep choosing trees from the old
    seconds."""
    import hashlib
    import importlib

    import jaxlib

    digest = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    for name in FORWARD_MODULES:
        with open(importlib.import_module(f"jaxspec.{name}").__file__, "rb") as f:
            digest.update(f.read())
    from jaxspec.kernels import small_product_columns, source_digest, tiled_columns

    digest.update(source_digest().encode())  # the C++ kernel's source (jaxspec/kernels/small_product.cc)
    if jax.default_backend() == "cpu":  # and where the per-layer forward uses it, and which of its loops
        digest.update(repr(sorted(small_product_columns())).encode())
        digest.update(repr(sorted(tiled_columns())).encode())
    return digest.hexdigest()[:16]


def _timing_file(kind: str, target, device: str) -> str:
    """A measurement's cache file in `cache_folder()`: per kind, device, target and forward code."""
    safe_device = re.sub(r"[^A-Za-z0-9_.-]", "_", device)
    return os.path.join(cache_folder(), f"{kind}-{safe_device}-{target.fingerprint()}-{forward_code_digest()}.json")


def cost_device(target, sampled: bool = False) -> str:
    """The device name of `target`'s cost model on this device: `device_name` with the weights' dtype, and "-sampled"
    for the model of rounds at a temperature (`measure_cost_model(sampled=True)`)."""
    return device_name(target.weights.embed.dtype) + ("-sampled" if sampled else "")


def cost_model_path(target, device: str | None = None, sampled: bool = False) -> str:
    """Where the cost model of `target` on `device` (default: this one, `cost_device(target, sampled)`) is cached, for
    the forward's current code (`forward_code_digest`)."""
    return _timing_file("cost-model", target, cost_device(target, sampled) if device is None else device)


def load_or_measure_cost_model(target, path: str | None = None, progress: bool = True, sampled: bool = False,
                               **measure_kwargs) -> CostModel:
    """The cached cost model of `target` on this device, measured (and cached) first when there is none.

    A cached file is used when it was measured on this device for this target with the same context and covers the
    requested batch sizes x token counts. When it lacks some of those cells, only they are measured and added to the
    file; when it is of another device, target or context, or cannot be read, the model is measured afresh.

    Args:
        target: a `jaxspec.loading.LoadedModel`.
        path: the JSON file; default `cost_model_path(target, sampled=sampled)`.
        progress: Show a progress bar while measuring.
        sampled: the cost model of rounds at a temperature (tokens drawn with Gumbel noise), in a file of its own.
        **measure_kwargs: batch_sizes, token_counts, context, repeats, passed to `measure_cost_model`.
    """
    path = cost_model_path(target, sampled=sampled) if path is None else path
    batch_sizes = measure_kwargs.get("batch_sizes", DEFAULT_BATCH_SIZES)
    token_counts = set(measure_kwargs.get("token_counts", DEFAULT_TOKEN_COUNTS)) | {1}
    context = measure_kwargs.get("context", DEFAULT_CONTEXT)
    cached = None
    if os.path.exists(path):
        try:
            cached = CostModel.load(path)
        except (OSError, ValueError, TypeError) as e:  # json and UserError are ValueErrors
            print(f"jaxspec: the cost model cache '{path}' is unreadable ({e}); measuring again.", file=sys.stderr)
        else:
            if (cached.device, cached.model, cached.context) != (cost_device(target, sampled), target.fingerprint(),
                                                                 context):
                cached = None
            elif cached.covers(batch_sizes, token_counts):
                return cached
    # only the cells the cache lacks are measured; the file keeps what it held, so that methods needing other
    # shapes do not keep re-measuring each other's
    cost = measure_cost_model(target, progress=progress, skip=frozenset(cached.measured()) if cached else frozenset(),
                              sampled=sampled, **measure_kwargs)
    cost = cached.merged(cost) if cached else cost
    cost.save(path)
    print(f"jaxspec: verification cost model cached in {path} (delete it to measure again)", file=sys.stderr)
    return cost


LAYOUT_CACHE_SIZE = 256  # cache slots of the decoding steps `chosen_layout` times


def chosen_layout(target, batch_size: int, requested: str | None = None, progress: bool = True) -> tuple[str, str]:
    """The CPU weight layout a generation command runs ("stacked" or "unstacked"), and a line saying why when it was
    chosen here ("" when it was given, or off CPU).

    `requested` ("stacked", "unstacked", "auto": choose) wins; when it is None, $JAXSPEC_LAYERS, else auto. Off
    CPU the stacked scan is the only layout. Otherwise the layout whose `batch_size`-row decoding step is faster on
    this machine (`jaxspec.generate.fastest_layout`, about a minute: both layouts compile), once per device, target,
    batch size and version of the forward (`forward_code_digest`) and cached as JSON in `cache_folder()`: a plain
    decoding step is the baseline every method is compared with, so jaxspec's own autoregressive decoding runs at
    its fastest and the speculative methods run on the same layout.
    """
    if requested not in (None, "auto", "stacked", "unstacked"):
        raise UserError(f"The layers layout must be auto, stacked or unstacked; got {requested!r}.")
    if requested in ("stacked", "unstacked"):
        return requested, ""
    if requested is None and os.environ.get(LAYERS_ENV):
        layout = os.environ[LAYERS_ENV]
        return layout, ""
    if jax.default_backend() != "cpu":
        return "stacked", ""
    from jaxspec.data import write_json
    from jaxspec.generate import fastest_layout

    path = _timing_file("layout", target, device_name(target.weights.embed.dtype, layout=False))
    choices = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                choices = json.load(f)
            if not isinstance(choices, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            print(f"jaxspec: the layout cache '{path}' is unreadable ({e}); measuring again.", file=sys.stderr)
            choices = {}
    key = str(int(batch_size))
    entry = choices.get(key)
    if not (isinstance(entry, dict) and entry.get("layout") in ("stacked", "unstacked")
            and isinstance(entry.get("step_seconds"), dict)):
        if progress:
            print(f"jaxspec: timing a batch-{batch_size} decoding step in both CPU layouts (once per machine, "
                  "about a minute) ...", file=sys.stderr)
        layout, seconds = fastest_layout(target.weights, target.config, batch_size, LAYOUT_CACHE_SIZE)
        entry = choices[key] = {"layout": layout, "step_seconds": seconds}
        write_json(path, choices)
    timed = ", ".join(f"{name} {float(sec) * 1e3:.1f} ms" for name, sec in entry["step_seconds"].items())
    return entry["layout"], (f"layers: {entry['layout']} (a batch-{batch_size} decoding step: {timed}; measured "
                             f"once, cached in {path}; --layers to choose)")


# ---------------------------------------------------------------------------------------------- choosing


def tau_model(budget: int, gain: float = DEFAULT_TAU_GAIN) -> float:
    """Expected tokens per round (accepted + bonus) at tree budget B: 1 + gain * log2(1 + B), a placeholder shape."""
    return 1.0 + gain * math.log2(1 + budget)


def _tau_function(tau) -> Callable[[int], float]:
    """budget -> tau from None (tau_model), a gain, a callable, or a dict {budget: measured tau}."""
    if tau is None:
        return tau_model
    if isinstance(tau, dict):
        if not tau:
            raise UserError("The measured taus are empty; pass at least one {budget: tau} pair, or none at all.")
        known = sorted((int(b), float(t)) for b, t in tau.items())
        if known[0][0] < 1:
            raise UserError(f"Measured taus need budgets >= 1; got {known[0][0]}.")
        log_budgets, taus = [math.log2(b) for b, _ in known], [t for _, t in known]
        return lambda budget: float(np.interp(math.log2(budget), log_budgets, taus))  # clamped at both ends
    if callable(tau):
        return tau
    if isinstance(tau, (int, float)) and not isinstance(tau, bool):
        return lambda budget: tau_model(budget, float(tau))
    raise UserError(f"tau must be None, a gain, a function of the budget or a dict {{budget: tau}}; got {tau!r}.")


def choose_budget(
    cost: CostModel,
    batch: int,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    tau=None,
    draft_seconds: Callable[[int, int], float] | None = None,
) -> tuple[int, list[dict]]:
    """The tree budget with the highest throughput at this batch size, and the table behind the choice.

    throughput(B) = batch * tau(B) / (cost.verify_seconds(batch, B + 1) + draft_seconds(batch, B)) tokens/s.

    Args:
        cost: the device's verification cost model.
        batch: rows decoded together.
        budgets: candidate numbers of drafted nodes per round; 0 is plain decoding (no draft, tau 1), which a
            method includes so that a tree is chosen only where it is expected to beat plain decoding.
        tau: expected tokens per round at budget B: None (`tau_model`), a gain for `tau_model`, a callable B -> tau,
            or a dict {B: measured tau} (other budgets interpolated in log2(B), held flat past the ends).
        draft_seconds: (batch, B) -> seconds of drafting per round; None for 0.

    Returns:
        (chosen budget, rows): one dict per budget, ascending, with "budget", "tau", "verify_seconds",
        "tokens_per_second" and "chosen". Ties go to the smaller budget.
    """
    if batch < 1:
        raise UserError(f"The batch size must be at least 1 to choose a tree budget; got {batch}.")
    budgets = sorted(set(int(b) for b in budgets))
    if not budgets or budgets[0] < 0:
        raise UserError(f"Candidate tree budgets must be a non-empty list of integers >= 0 (0: plain decoding); got "
                        f"{budgets}.")
    tau_of = _tau_function(tau)
    rows = []
    for budget in budgets:
        expected = 1.0 if budget == 0 else float(tau_of(budget))  # plain decoding: one token a step
        if not expected > 0:
            raise UserError(f"tau at budget {budget} is {expected}; expected tokens per round must be positive.")
        verify = cost.verify_seconds(batch, budget + 1)
        draft = 0.0 if draft_seconds is None or budget == 0 else float(draft_seconds(batch, budget))
        rows.append({
            "budget": budget,
            "tau": expected,
            "verify_seconds": verify,
            "tokens_per_second": batch * expected / (verify + draft),
            "chosen": False,
        })
    best = rows[0]
    for row in rows[1:]:  # ascending, strictly better only: ties keep the smaller budget
        if row["tokens_per_second"] > best["tokens_per_second"]:
            best = row
    best["chosen"] = True
    return best["budget"], rows


def format_budget_table(rows: list[dict]) -> str:
    """A plain-text table of `choose_budget`'s rows, the chosen one marked with '*'."""
    lines = [f"{'budget':>7} {'tau':>6} {'verify ms':>10} {'tokens/s':>10}"]
    for row in rows:
        mark = "  *" if row["chosen"] else ""
        lines.append(f"{row['budget']:>7} {row['tau']:>6.2f} {row['verify_seconds'] * 1e3:>10.3f} "
                     f"{row['tokens_per_second']:>10.1f}{mark}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- EAGLE tree shapes


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree: `depth` head forwards, `top_k` children per expanded node, `num_nodes` of the head's
    nodes verified, and a prompt-lookup chain of `lookup` tokens merged in (`jaxspec.tree.merge_chain`; 0: none).

    A chain is top_k = 1, num_nodes = depth. A depth-2 tree with num_nodes = top_k + top_k**2 keeps every node
    EAGLE-2's expansion makes, so the target's path is in it exactly when its first two tokens rank below top_k.
    A round verifies num_nodes + lookup drafted tokens.
    """

    depth: int
    top_k: int
    num_nodes: int
    lookup: int = 0

    @property
    def verified_nodes(self) -> int:
        return self.num_nodes + self.lookup

    @property
    def plain(self) -> bool:
        """No draft at all: each step verifies the root alone, which is plain decoding (`PLAIN`)."""
        return self.verified_nodes == 0


# Chains of 1 to 6 tokens (small rounds win where verifying many tokens is dear: CPUs), the head's top 2, 3 or 4 first
# tokens side by side (sampled rounds: one of them is kept with their probability mass together, where a chain's
# next level adds only the product of two top-1 masses) and full depth-2 trees of 2, 3 and 4 children per node (wide
# rounds win where extra tokens are nearly free: accelerators at small batches);
# then short chains and small trees with a prompt-lookup chain merged in (it drafts the text's own repeats: code,
# lists, worked arithmetic), which costs no head forward, only the verified tokens. Lookup chains up to 12: copied
# code runs long (greedy HumanEval answers: a chain of 8 keeps 1.96 tokens per position on average, 5 keeps 1.43);
# and of 1 or 2, where each verified token is dear (sampled rounds on a CPU: their first token alone, or the head's
# second choice in its slot where the chain finds nothing, keeps more than a level of the head's chain).
# And no draft at all (`PLAIN`, first, so that a tree must beat it): where every round costs more than the tokens it
# adds (a CPU at batch 8, or a head that is rarely right), plain decoding is the fastest choice.
PLAIN = TreeShape(0, 0, 0)
HEAD_SHAPES = (tuple(TreeShape(d, 1, d) for d in range(1, 7)) + tuple(TreeShape(1, k, k) for k in (2, 3, 4))
               + tuple(TreeShape(2, k, k + k * k) for k in (2, 3, 4)))
TREE_SHAPES = (PLAIN,) + HEAD_SHAPES + tuple(
    TreeShape(d, 1, d, lookup) for d in range(1, 5) for lookup in (1, 2, 3, 5, 8, 12)) + tuple(
    TreeShape(2, k, k + k * k, 4) for k in (2, 3))


# Token counts (nodes + 1) of the head-only shapes, measured for the EAGLE cost model (the others interpolated).
EAGLE_TOKEN_COUNTS = tuple(sorted({1} | {s.num_nodes + 1 for s in HEAD_SHAPES} - {6}))  # 6: interpolated


def _check_modelled(shape: TreeShape) -> None:
    """Refuses a shape whose acceptance the tau models do not cover: only chains and full depth-1 or depth-2 trees
    (every child of every expanded node kept), and `PLAIN`, are exact under them."""
    if shape.plain:
        return
    chain = shape.top_k == 1 and shape.num_nodes == shape.depth
    full_tree = (shape.depth == 1 and shape.num_nodes == shape.top_k) or (
        shape.depth == 2 and shape.num_nodes == shape.top_k + shape.top_k ** 2)
    if not (chain or full_tree):
        raise UserError(f"{shape} is neither a chain nor a full depth-2 tree; its acceptance is not modelled.")


def expected_tokens_per_round(ranks: np.ndarray, shape: TreeShape, lookup_runs: np.ndarray | None = None,
                              lookup_valid: np.ndarray | None = None) -> float:
    """Expected tokens a round yields (accepted drafts + the bonus) at T=0, from the drafter's measured ranks.

    ranks: int[P, D]: at P positions of text the target generated, the rank of the target's own next token at depth
    j + 1 among the head's candidates when the head is fed the true tokens before it (teacher forcing along the
    target's path, which is exactly what a round drafts for as long as its drafts are accepted); a large value where
    the token is outside the draft vocabulary or the text ends. D must be at least the shape's depth.
    lookup_runs: int[P], at the same positions, how many leading tokens of the prompt-lookup chain equal the text's
    (`jaxspec.drafters.prompt_lookup.lookup_statistics`); needed when shape.lookup > 0. The merged tree holds both
    paths, so a round keeps the longer. lookup_valid: int[P], how many of the chain's tokens are valid there: the
    slots past its end hold the head's next-ranked first tokens (`jaxspec.tree.merge_chain`), so the head's first
    draft is also kept when it ranks below top_k + those slots (None: no such slots counted, a lower bound).

    A chain keeps depth j's draft iff ranks 1..j are all 0; a full depth-2 tree iff they are all below top_k. Other
    shapes are not exact under this model and are refused.
    """
    ranks = np.asarray(ranks)
    if ranks.ndim != 2 or ranks.shape[1] < shape.depth or len(ranks) == 0:
        raise UserError(f"Measured draft ranks of shape {ranks.shape} do not cover depth {shape.depth}.")
    _check_modelled(shape)
    if shape.plain:
        return 1.0
    inside = ranks[:, : shape.depth] < shape.top_k  # [P, depth]
    accepted = np.cumprod(inside, axis=1).sum(axis=1)  # [P]: drafts kept before the first miss
    if shape.lookup:
        if lookup_runs is None or np.shape(lookup_runs) != (len(ranks),):
            raise UserError(f"{shape} merges a prompt-lookup chain: its acceptance needs the lookup runs measured at "
                            f"the ranks' {len(ranks)} positions.")
        if lookup_valid is not None:
            if np.shape(lookup_valid) != (len(ranks),):
                raise UserError(f"The lookup chain's valid counts must be measured at the ranks' {len(ranks)} "
                                f"positions; got shape {np.shape(lookup_valid)}.")
            spare = shape.lookup - np.minimum(np.asarray(lookup_valid), shape.lookup)  # [P]: slots past its end
            accepted = np.maximum(accepted, ranks[:, 0] < shape.top_k + spare)  # a spare first token kept
        accepted = np.maximum(accepted, np.minimum(np.asarray(lookup_runs), shape.lookup))  # [P]
    return 1.0 + float(accepted.mean())


@dataclasses.dataclass(frozen=True)
class SampledText:
    """What a round drafts along the answers the target sampled for the calibration (the text `draft_mass` is
    measured along), at the same positions: the rank of the text's own next token among the head's candidates at
    each depth (ranks int[P, D], teacher-forced as `jaxspec.drafters.eagle.draft_ranks`), and how many leading tokens
    of the prompt-lookup chain equal the text's and how many of them are valid (lookup_runs, lookup_valid int[P],
    `jaxspec.drafters.prompt_lookup.lookup_statistics`). A sampled round keeps a deterministic draft exactly when the
    target draws its token, and the sampled text is such a draw, so these give an unbiased estimate of what the
    merged tree keeps at T > 0 (`expected_tokens_sampled`)."""

    ranks: np.ndarray  # int[P, D]
    lookup_runs: np.ndarray  # int[P]
    lookup_valid: np.ndarray  # int[P]


def expected_tokens_sampled(mass: np.ndarray, shape: TreeShape, sampled_text: SampledText | None = None) -> float:
    """Expected tokens a sampled round (T > 0) yields, from the target's measured probabilities of the head's
    candidates (`jaxspec.drafters.eagle.draft_statistics`).

    mass: float[P, D, K]: at P positions, the target's probability of the head's top-k step-j candidates together
    (k = 1..K). The children of a node are the head's top-k tokens, drafted deterministically, so one of them is
    kept with exactly their probability mass under the target; a chain keeps depth j with the product of its
    levels' top-1 masses, a full depth-2 tree with m1 + m1 * m2 of its top_k masses. The masses of deeper levels
    are measured after the text's own tokens (teacher forcing), an approximation when the kept child differs from
    them. Shapes that are neither chains nor full trees are refused.

    A shape with a prompt-lookup chain needs `sampled_text` (the same P positions): its tau is the head's, from the
    masses, plus what merging the chain adds along the sampled text, where a position keeps the longer of the
    head's run and the chain's, and the chain's empty slots hold the head's next-ranked first tokens
    (`expected_tokens_per_round` on those ranks and runs, with the chain and without).
    """
    mass = np.asarray(mass, np.float64)
    if mass.ndim != 3 or mass.shape[1] < shape.depth or mass.shape[2] < shape.top_k or len(mass) == 0:
        raise UserError(f"Measured draft masses of shape {mass.shape} do not cover depth {shape.depth} and "
                        f"top_k {shape.top_k}.")
    _check_modelled(shape)
    if shape.plain:
        return 1.0
    levels = mass[:, : shape.depth, shape.top_k - 1]  # [P, depth]: a level kept given the one above was
    head_tau = 1.0 + float(np.cumprod(levels, axis=1).sum(axis=1).mean())
    if not shape.lookup:
        return head_tau
    if sampled_text is None:
        raise UserError(f"{shape} merges a prompt-lookup chain: at T > 0 its acceptance needs the head's ranks and "
                        "the chain's runs measured along sampled text (SampledText).")
    if len(sampled_text.ranks) != len(mass):
        raise UserError(f"The sampled text's ranks ({len(sampled_text.ranks)} positions) must be measured at the "
                        f"masses' {len(mass)} positions.")
    head = TreeShape(shape.depth, shape.top_k, shape.num_nodes)
    merged = expected_tokens_per_round(sampled_text.ranks, shape, sampled_text.lookup_runs, sampled_text.lookup_valid)
    return head_tau + merged - expected_tokens_per_round(sampled_text.ranks, head)


def choose_tree(cost: CostModel, batch: int, ranks: np.ndarray, draft_seconds: Callable[[int, TreeShape], float],
                shapes: Sequence[TreeShape] = TREE_SHAPES, lookup_runs: np.ndarray | None = None,
                draft_mass: np.ndarray | None = None, lookup_valid: np.ndarray | None = None,
                sampled_text: SampledText | None = None) -> tuple[TreeShape, list[dict]]:
    """The EAGLE tree shape with the highest expected throughput at this batch size, and the table behind it.

    throughput = batch * tau(shape) / (cost.verify_seconds(batch, nodes + 1) + draft_seconds(batch, shape)), with
    tau at T=0 from the drafter's measured ranks and, for shapes with a prompt-lookup chain, the measured
    `lookup_runs` and `lookup_valid` (`expected_tokens_per_round`; without runs those shapes are left out); for a
    sampled run (T > 0) pass `draft_mass`: tau then comes from the target's probabilities of the head's candidates
    and, for the lookup shapes, from `sampled_text` (`expected_tokens_sampled`; without it those shapes are left
    out). Each row also gives the expected speedup over
    plain decoding on the same cost model (batch / verify_seconds(batch, 1) tokens/s). `PLAIN` among the shapes (it
    is the first of TREE_SHAPES) is that plain decoding itself: chosen when no tree is expected to beat it.

    Returns:
        (chosen shape, rows): one dict per shape with "shape", "tau", "verify_seconds", "draft_seconds",
        "tokens_per_second", "speedup" and "chosen". Ties go to the earlier shape.
    """
    if batch < 1:
        raise UserError(f"The batch size must be at least 1 to choose a tree; got {batch}.")
    if not shapes:
        raise UserError("No candidate tree shapes were given.")
    if (lookup_runs if draft_mass is None else sampled_text) is None:
        shapes = [s for s in shapes if not s.lookup]
        if not shapes:
            raise UserError("Every candidate shape merges a prompt-lookup chain, and its acceptance is not measured "
                            "(no lookup runs, or at T > 0 no sampled text).")
    plain = batch / cost.verify_seconds(batch, 1)
    rows = []
    for shape in shapes:
        if draft_mass is not None:
            tau = expected_tokens_sampled(draft_mass, shape, sampled_text)
        else:
            tau = expected_tokens_per_round(ranks, shape, lookup_runs, lookup_valid)
        verify = cost.verify_seconds(batch, shape.verified_nodes + 1)
        draft = float(draft_seconds(batch, shape))
        speed = batch * tau / (verify + draft)
        rows.append({"shape": shape, "tau": tau, "verify_seconds": verify, "draft_seconds": draft,
                     "tokens_per_second": speed, "speedup": speed / plain, "chosen": False})
    best = rows[0]
    for row in rows[1:]:
        if row["tokens_per_second"] > best["tokens_per_second"]:
            best = row
    best["chosen"] = True
    return best["shape"], rows


def eagle_draft_seconds(cost: CostModel, batch: int, shape: TreeShape, *, target_work: int, layer_work: int,
                        fuse_work: int, vocab_work: int) -> float:
    """Seconds an EAGLE head drafts one round of `shape` at this batch size, on the target's verification cost model.

    Every matrix is costed at the target's own seconds per weight at that many tokens per row (one verification
    forward over n tokens per row multiplies `target_work` weights: its layers and its LM head), so a head matrix
    of w weights over n tokens costs w * verify_seconds(batch, n) / target_work. A round runs the head's layer and
    feature fusion over the last round's pairs (verified nodes + 1), the head's LM head over the draft vocabulary on
    the root, then for each further depth the layer and the LM head over the top_k frontier nodes.

    Args:
        target_work: weights multiplied by one target forward per token (its layers, plus vocabulary x width);
        layer_work, fuse_work, vocab_work: the head's decoder layer, its fusion of the feature layers, its LM head.
    """
    def per_weight(tokens: int) -> float:  # seconds per weight of a product over `tokens` tokens per row
        return cost.verify_seconds(batch, tokens) / target_work

    if shape.plain:
        return 0.0  # no head runs
    absorb = (layer_work + fuse_work) * per_weight(shape.verified_nodes + 1) + vocab_work * per_weight(1)
    return absorb + (shape.depth - 1) * (layer_work + vocab_work) * per_weight(shape.top_k)


# A draft model's chains (`jaxspec.drafters.DraftModelDrafter` with --budget auto, its default): no draft, or 1 to
# DRAFT_MODEL_DEPTH tokens. A draft model that keeps nearly every token (Qwen2.5-Coder-0.5B for -1.5B on code: about
# 0.97 of its first drafts) pays for long chains where its forward is cheap against the target's.
DRAFT_MODEL_DEPTH = 10
CHAIN_SHAPES = (PLAIN,) + tuple(TreeShape(d, 1, d) for d in range(1, DRAFT_MODEL_DEPTH + 1))
CHAIN_TOKEN_COUNTS = (1, 2, 3, 4, 5, 7, 9, 11)  # the verification sizes measured for them (6, 8, 10 interpolated)


def draft_model_seconds(cost: CostModel, batch: int, shape: TreeShape, *, target_work: int, draft_work: int) -> float:
    """Seconds a draft model drafts a chain of `shape.depth` tokens at this batch size, on the target's verification
    cost model: one forward over the last two committed tokens (`DraftModelDrafter.propose`), then one per further
    token, each costed at the target's own seconds per weight at that many tokens per row (one target forward over
    n tokens per row multiplies `target_work` weights), times the draft model's `draft_work`.

    Args:
        target_work: weights one target forward multiplies per token (its layers, plus vocabulary x width);
        draft_work: the draft model's, weighed by the bytes it reads per weight against the target's (a draft
            model read in bfloat16 beside a float32 target counts half).
    """
    if shape.plain:
        return 0.0  # no draft model runs
    per_weight = [cost.verify_seconds(batch, tokens) / target_work for tokens in (1, 2)]
    return draft_work * (per_weight[1] + (shape.depth - 1) * per_weight[0])


def format_tree_table(rows: list[dict]) -> str:
    """A plain-text table of `choose_tree`'s rows, the chosen one marked with '*'."""
    lines = [f"{'depth':>5} {'top_k':>5} {'nodes':>5} {'lookup':>6} {'tau':>6} {'verify ms':>10} {'draft ms':>9} "
             f"{'tokens/s':>9} {'speedup':>8}"]
    for row in rows:
        s = row["shape"]
        mark = "  *" if row["chosen"] else ""
        lines.append(f"{s.depth:>5} {s.top_k:>5} {s.num_nodes:>5} {s.lookup:>6} {row['tau']:>6.2f} "
                     f"{row['verify_seconds'] * 1e3:>10.2f} {row['draft_seconds'] * 1e3:>9.2f} "
                     f"{row['tokens_per_second']:>9.1f} {row['speedup']:>7.2f}x{mark}")
    return "\n".join(lines)
