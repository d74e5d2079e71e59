"""The target distribution p: temperature, top-k and top-p applied to logits, and sampling from it.

Every decoding path (autoregressive and speculative verification) takes p from `target_probs` /
`process_logits`, so "the distribution after the user's temperature / top-k / top-p" means the same thing
everywhere. Temperature 0 means greedy: p is a point mass on the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import UserError


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are chosen. temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters.

    A pytree, passed to the jitted loops as an ordinary argument: its structure (greedy or not, top-k on or off,
    top-p on or off) is static and compiles once per kind, while the temperature, top-k and top-p values are traced,
    so a sweep over any of them reuses one compiled loop.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        object.__setattr__(self, "_structure", (self.temperature == 0.0, self.top_k > 0, self.top_p < 1.0))

    @property
    def greedy(self) -> bool:
        return self._structure[0]

    @property
    def filters_top_k(self) -> bool:
        """Whether the top-k filter is on (static, also when top_k itself is traced)."""
        return self._structure[1]

    @property
    def filters_top_p(self) -> bool:
        """Whether the top-p filter is on (static, also when top_p itself is traced)."""
        return self._structure[2]

    def tree_flatten(self):
        return (self.temperature, self.top_k, self.top_p), self._structure

    @classmethod
    def tree_unflatten(cls, structure, values):
        config = object.__new__(cls)  # no validation: the values may be tracers; they were checked when created
        for name, value in (("temperature", values[0]), ("top_k", values[1]), ("top_p", values[2]),
                            ("_structure", structure)):
            object.__setattr__(config, name, value)
        return config


GREEDY = SamplingConfig()


# ---------------------------------------------------------------------------------------------- vocabulary shards
# Inside `shard_map` the vocabulary may be split over a mesh axis (`vocab_axis`): each device holds logits for a
# contiguous slice [offset, offset + V_local). These helpers reduce over the whole vocabulary with collectives of a
# few numbers per row instead of gathering the logits; with vocab_axis None they are the plain reductions.


def vocab_offset(local_size: int, vocab_axis: str | None) -> jax.Array | int:
    """Index of this device's first vocabulary entry (0 on one device)."""
    return 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * local_size


def vocab_sum(x: jax.Array, vocab_axis: str | None) -> jax.Array:
    """Sums per-shard partial results over the vocabulary axis."""
    return x if vocab_axis is None else jax.lax.psum(x, vocab_axis)


def vocab_max(x: jax.Array, vocab_axis: str | None) -> jax.Array:
    return x if vocab_axis is None else jax.lax.pmax(x, vocab_axis)


def vocab_argmax(logits: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """logits: [..., V_local] -> int32[...] global index of the largest logit (the first one on ties, as argmax)."""
    local = jnp.argmax(logits, axis=-1).astype(jnp.int32) + vocab_offset(logits.shape[-1], vocab_axis)
    if vocab_axis is None:
        return local
    best = jnp.max(logits, axis=-1)
    top = jax.lax.pmax(best, vocab_axis)
    return jax.lax.pmin(jnp.where(best == top, local, jnp.iinfo(jnp.int32).max), vocab_axis)


def vocab_pick(x: jax.Array, index: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """x: [V_local] -> x[index] for a global vocabulary index (scalar), from whichever device holds it."""
    if vocab_axis is None:
        return x[index]
    local = index - vocab_offset(x.shape[-1], vocab_axis)
    inside = (local >= 0) & (local < x.shape[-1])
    return jax.lax.psum(jnp.where(inside, x[jnp.clip(local, 0, x.shape[-1] - 1)], 0), vocab_axis)


def vocab_one_hot(index: jax.Array, local_size: int, vocab_axis: str | None = None, dtype=jnp.float32) -> jax.Array:
    """This device's slice [..., V_local] of the one-hot vector of a global index [...]."""
    return jax.nn.one_hot(index - vocab_offset(local_size, vocab_axis), local_size, dtype=dtype)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-inf lowest); equal floats give equal keys (-0.0 == +0.0)."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _cutoff(keys: jax.Array, weights: jax.Array, threshold, vocab_axis: str | None) -> jax.Array:
    """The smallest key c such that the entries with keys > c weigh less than `threshold` in all: the kept set
    {key >= c} is the smallest prefix (in descending key order) whose weight reaches the threshold, ties kept
    together. With weights p it is top-p's set; with weights 1 and threshold k, top-k's (the k largest and their ties).

    keys: uint32 [..., V_local] (`_sortable` logits); weights: [..., V_local]; threshold: a scalar, traced or not;
    returns keys [..., 1]. A bisection over the 32-bit keys: 32 steps of one masked sum each (psum'd over the
    vocabulary shards), no sort and no gather, so k and p can be traced values.
    """

    def weight_above(cut):  # [..., 1] the weight on keys > cut
        return vocab_sum(jnp.sum(jnp.where(keys > cut, weights, 0.0), axis=-1, keepdims=True), vocab_axis)

    hi = vocab_max(jnp.max(keys, axis=-1, keepdims=True), vocab_axis)  # [..., 1]
    lo = hi * 0  # zeros varying over the same mesh axes as hi (a shard_map loop carry must keep its type)

    def step(_, bounds):
        lo, hi = bounds  # the answer lies in [lo, hi]; weight_above(hi) < threshold always (nothing is above the max)
        mid = lo + (hi - lo) // 2
        below = weight_above(mid) < threshold
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))  # 32 halvings of the 2^32 keys
    return hi


def process_logits(logits: jax.Array, sampling: SamplingConfig, vocab_axis: str | None = None) -> jax.Array:
    """logits: float[..., V] -> float32 log-probabilities [..., V] of p (-inf outside the kept set).

    For greedy sampling the result is a point mass on the argmax (log 1 there, -inf elsewhere). Inside
    `shard_map` with the vocabulary split over `vocab_axis`, logits and result are this device's slice.
    """
    logits = logits.astype(jnp.float32)
    local_size = logits.shape[-1]
    if sampling.greedy:
        top = vocab_argmax(logits, vocab_axis)
        return jnp.where(vocab_one_hot(top, local_size, vocab_axis, jnp.bool_), 0.0, -jnp.inf)
    logits = logits / sampling.temperature
    if sampling.filters_top_k:  # the k largest logits and their ties (k traced; k >= V keeps everything)
        keys = _sortable(logits)  # [..., V_local]
        cutoff = _cutoff(keys, jnp.ones_like(logits), sampling.top_k, vocab_axis)  # [..., 1]
        logits = jnp.where(keys < cutoff, -jnp.inf, logits)
    if sampling.filters_top_p:  # the smallest prefix holding top_p of the mass
        top = vocab_max(jnp.max(logits, axis=-1, keepdims=True), vocab_axis)
        weights = jnp.exp(logits - top)  # unnormalised p, [..., V_local]
        total = vocab_sum(jnp.sum(weights, axis=-1, keepdims=True), vocab_axis)
        keys = _sortable(logits)
        cutoff = _cutoff(keys, weights / total, sampling.top_p, vocab_axis)  # [..., 1]
        logits = jnp.where(keys < cutoff, -jnp.inf, logits)
    top = vocab_max(jnp.max(logits, axis=-1, keepdims=True), vocab_axis)
    log_total = jnp.log(vocab_sum(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True), vocab_axis))
    return logits - top - log_total


SAMPLE_BLOCK = 256  # vocabulary entries per block of `sample_from`'s two-level search


def _block_sums(blocks: jax.Array) -> jax.Array:
    """[NB, block] -> [NB], each block's sum as a product with ones: XLA:CPU runs a reduction over the vocabulary as
    one serial chain of adds (0.12 ms for 49k entries here), a matrix-vector product in a few microseconds."""
    return jnp.dot(blocks, jnp.ones((blocks.shape[1],), blocks.dtype), precision=jax.lax.Precision.HIGHEST)


def sample_from(probs: jax.Array, uniform: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """Inverse-CDF draw from probs [V] (non-negative, unnormalised is fine) with a uniform in [0, 1): the first
    index whose cumulative mass passes uniform * total; never a zero-mass token.

    The CDF is searched in two levels rather than summed entry by entry (XLA:CPU's cumulative sum over a 49k
    vocabulary took 0.55 ms here): the running mass of blocks of SAMPLE_BLOCK entries finds the block the draw falls
    in, then the running sum inside that block alone the token. Should rounding put the draw past the block's own
    running sum (the two sum in different orders), the block's last token of nonzero mass is taken; should it put
    the draw past the whole running mass, the last token of nonzero mass.

    With a vocab_axis (inside shard_map), probs is this device's slice: its running mass starts at the mass of the
    slices before it (one all-gather of a number per device), and the first index above the draw is a min over
    devices. Returns int32[] (a global index).
    """
    local_size = probs.shape[0]
    offset = vocab_offset(local_size, vocab_axis)
    block = min(SAMPLE_BLOCK, local_size)
    blocks = jnp.pad(probs, (0, -local_size % block)).reshape(-1, block)  # [NB, block]
    sums = _block_sums(blocks)  # [NB]
    ends = jnp.cumsum(sums)  # [NB] running mass at each block's end
    before = 0.0
    total = ends[-1]
    if vocab_axis is not None:
        slice_mass = jax.lax.all_gather(total, vocab_axis)  # [devices]
        before = jnp.sum(jnp.where(jnp.arange(slice_mass.shape[0]) < jax.lax.axis_index(vocab_axis), slice_mass, 0.0))
        ends = ends + before
        total = jnp.sum(slice_mass)
    draw = uniform * total
    passed = ends > draw  # [NB]
    b = jnp.argmax(passed)  # the first block whose running mass passes the draw
    start = jnp.where(b > 0, ends[jnp.maximum(b - 1, 0)], before)
    inside = jax.lax.dynamic_index_in_dim(blocks, b, keepdims=False)  # [block]
    inside_passed = start + jnp.cumsum(inside) > draw  # [block]
    in_block = jnp.where(jnp.any(inside_passed), jnp.argmax(inside_passed), _last_positive(inside))
    never = jnp.iinfo(jnp.int32).max
    first_above = jnp.where(jnp.any(passed), b * block + in_block + offset, never)
    last_block = sums.shape[0] - 1 - jnp.argmax((sums > 0)[::-1])  # the last block holding mass
    last_nonzero = jnp.where(jnp.any(sums > 0), last_block * block + offset + _last_positive(
        jax.lax.dynamic_index_in_dim(blocks, last_block, keepdims=False)), -1)
    if vocab_axis is not None:
        first_above = jax.lax.pmin(first_above, vocab_axis)
        last_nonzero = jax.lax.pmax(last_nonzero, vocab_axis)
    return jnp.where(first_above < never, first_above, last_nonzero).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """x: [N] -> the index of its last positive entry (N - 1 when there is none)."""
    return x.shape[0] - 1 - jnp.argmax((x > 0)[::-1])


def sample_categorical(rng: jax.Array, log_probs: jax.Array) -> jax.Array:
    """One draw per row from log-probabilities [..., V] (-inf: never) -> int32[...]: an inverse-CDF draw
    (`sample_from`) with one uniform per row. The same distribution as `jax.random.categorical`, which draws a
    Gumbel variate for every vocabulary entry (3 ms a row for a 49k vocabulary on XLA:CPU here, a tenth of a
    decoding step)."""
    lead = log_probs.shape[:-1]
    uniforms = jax.random.uniform(rng, lead).reshape(-1)  # [N]
    probs = jnp.exp(log_probs.astype(jnp.float32)).reshape(-1, log_probs.shape[-1])  # [N, V]
    return jax.vmap(sample_from)(probs, uniforms).reshape(lead)


def target_probs(logits: jax.Array, sampling: SamplingConfig, vocab_axis: str | None = None) -> jax.Array:
    """logits: [..., V] -> float32 probabilities [..., V] of p (this device's vocabulary slice inside shard_map)."""
    return jnp.exp(process_logits(logits, sampling, vocab_axis))


def draws_by_argmax(sampling: SamplingConfig) -> bool:
    """Whether a token under `sampling` can be drawn as the argmax of logits + `gumbel_noise` (static): greedy (no
    noise), or a temperature alone (the Gumbel-max rule: argmax(logits + T g), g standard Gumbel for every token, is
    a draw from softmax(logits / T)). Not with top-k or top-p, whose kept set needs every logit."""
    return not (sampling.filters_top_k or sampling.filters_top_p)


def gumbel_noise(rng: jax.Array, shape: tuple[int, ...], sampling: SamplingConfig) -> jax.Array | None:
    """temperature x standard Gumbel noise, float32[shape] ([..., V]), for `draws_by_argmax`; None when greedy."""
    if sampling.greedy:
        return None
    return sampling.temperature * jax.random.gumbel(rng, shape, jnp.float32)


def sample_token(rng: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits: [B, V] -> int32[B], argmax when greedy, else a draw from p."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_categorical(rng, process_logits(logits, sampling))
