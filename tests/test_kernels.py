"""The CPU kernels (jaxspec/kernels): the product with a few columns and the attention over the cache, their results
against numpy in float64 and XLA, where the per-layer forward calls them, and how the columns served are chosen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.errors import UserError


def _kernel_or_skip():
    why_not = kernels.load_kernel()
    if why_not is not None:
        pytest.skip(f"the small-product kernel is unavailable here: {why_not}")


@pytest.mark.parametrize("out,inner", [(7, 13), (64, 576), (131, 1539)])
def test_the_kernel_computes_w_times_x_for_1_to_16_columns(out, inner):
    """By its one-row loop and by its 4-row tiles; odd row counts (the tiles' last rows) and inner sizes that are not
    a multiple of 8 (the vector loop's tail) included."""
    _kernel_or_skip()
    rng = np.random.default_rng(out)
    w = rng.standard_normal((out, inner), np.float32)  # [out, in]
    product = jax.jit(kernels.kernel_product, static_argnums=2)
    for n in range(1, kernels.MAX_COLUMNS + 1):
        x = rng.standard_normal((inner, n), np.float32)  # [in, N]
        want = w.astype(np.float64) @ x.astype(np.float64)
        for tiles in (False, True):
            got = np.asarray(product(jnp.asarray(w), jnp.asarray(x), tiles))  # [out, N]
            assert got.shape == (out, n)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(inner) * np.abs(want).max())


@pytest.mark.parametrize("out,inner", [(7, 13), (64, 576), (131, 1539)])
def test_the_bfloat16_product_equals_the_float32_kernel_on_its_widened_matrix_bit_for_bit(out, inner):
    """`bf16_product` (an EAGLE head's matrices kept in bfloat16) widens the weights exactly in registers and sums in
    the float32 kernel's order: the same numbers at every column count (the one-row loops and the tiles, their
    tails included)."""
    _kernel_or_skip()
    rng = np.random.default_rng(out)
    w = jnp.asarray(rng.standard_normal((out, inner), np.float32), jnp.bfloat16)  # [out, in]
    widened = w.astype(jnp.float32)  # [out, in], the same values
    half = jax.jit(kernels.bf16_product, static_argnums=2)
    full = jax.jit(kernels.kernel_product, static_argnums=2)
    for n in range(1, kernels.MAX_COLUMNS + 1):
        x = jnp.asarray(rng.standard_normal((inner, n), np.float32))  # [in, N]
        want = np.asarray(widened, np.float64) @ np.asarray(x, np.float64)
        for tiles in (False, True):
            got = np.asarray(half(w, x, tiles))  # [out, N]
            assert got.dtype == np.float32 and got.shape == (out, n)
            np.testing.assert_array_equal(got, np.asarray(full(widened, x, tiles)))
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(inner) * np.abs(want).max())


@pytest.mark.parametrize("vocab,d", [(131, 70), (66, 20), (1000, 576)])
def test_the_greedy_head_kernel_gives_the_float32_argmax_for_1_to_16_positions(vocab, d):
    """The screen's tiles (4 rows and up to 5 positions at once where the CPU has AVX-512) and their tails: token counts
    that are not a multiple of 4, widths that are not a multiple of 32 (or below it). The screen is the rows rounded
    to bfloat16 with its honest error bound, so a screen that computed wrong logits would certify a wrong token."""
    _kernel_or_skip()
    rng = np.random.default_rng(vocab)
    rows = rng.standard_normal((vocab, d)).astype(np.float32)  # [V, d]
    screen = rows.astype(jnp.bfloat16)  # [V, d]
    rows64, screened64 = rows.astype(np.float64), np.asarray(screen.astype(np.float32), np.float64)
    unit = 2.0 ** -24
    error = (np.sqrt(np.max(np.sum((screened64 - rows64) ** 2, axis=1)))
             + 2 * d * unit / (1 - d * unit) * np.sqrt(np.max(np.sum(rows64 ** 2, axis=1))))
    head = jax.jit(kernels.greedy_head)
    for n in range(1, kernels.MAX_COLUMNS + 1):
        h = rng.standard_normal((n, d)).astype(np.float32)  # [N, d]
        got = np.asarray(head(jnp.asarray(screen), jnp.asarray(rows), jnp.asarray(h), jnp.float32(error)))  # [N]
        logits = h.astype(np.float64) @ rows64.T  # [N, V]
        ranked = np.sort(logits, axis=1)
        clear = ranked[:, -1] - ranked[:, -2] > 1e-4 * np.abs(ranked[:, -1])  # [N] no float32 near-tie
        assert clear.sum() >= n - 1
        np.testing.assert_array_equal(got[clear], np.argmax(logits, axis=1)[clear])


def _custom_calls(columns: int, dtype=jnp.float32, target: str = kernels.TARGET_NAME, tiles: bool | None = None) -> int:
    """How many calls of the kernel `target` a product over `columns` columns lowers to (with `tiles`: only those
    that run its tiles, or with False its one-row loop)."""
    w = jnp.ones((32, 16), dtype)  # [out, in]
    x = jnp.ones((16, columns), jnp.float32)  # [in, N]
    traced = jax.jit(lambda w, x: kernels.feature_major_product(w, x))  # a new function: traced afresh
    lines = [line for line in traced.lower(w, x).as_text().splitlines() if target in line]
    if tiles is not None:
        lines = [line for line in lines if f"tiles = {int(tiles)} : i32" in line]
    return len(lines)


def test_feature_major_products_use_the_kernel_for_the_columns_chosen(monkeypatch):
    """float32 matrices, and bfloat16 ones at the same column counts (so a bfloat16 head computes what its float32
    copy does, kernel or XLA)."""
    _kernel_or_skip()
    try:
        for setting, served in [("16", range(1, 17)), ("3", range(1, 4)), ("off", ())]:
            monkeypatch.setenv(kernels.ENV, setting)
            kernels.small_product_columns.cache_clear()
            kernels.tiled_columns.cache_clear()
            for n in range(1, 19):
                assert _custom_calls(n) == (1 if n in served else 0), (setting, n)
                assert _custom_calls(n, jnp.bfloat16, kernels.BF16_PRODUCT_TARGET_NAME) == (1 if n in served else 0)
                # columns given by hand: the tiles from 9 on (DEFAULT_TILED)
                assert _custom_calls(n, tiles=True) == (1 if n in served and n >= 9 else 0), (setting, n)
        monkeypatch.setenv(kernels.ENV, "seventeen")
        kernels.small_product_columns.cache_clear()
        with pytest.raises(UserError, match="column count from 1 to 16"):
            kernels.small_product_columns()
    finally:
        kernels.small_product_columns.cache_clear()
        kernels.tiled_columns.cache_clear()


@pytest.mark.parametrize("one_column", [(24.0, 21.5), (21.5, 24.0)])
def test_the_columns_are_measured_once_and_cached(monkeypatch, tmp_path, one_column):
    """Unset, the column counts are those at which the kernel was faster, measured once (the timings here replaced
    by made-up ones: 2-16 columns on chains of products, one column on decoding steps) and read back from the cache
    file after."""
    _kernel_or_skip()
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernels.ENV, "auto")
    calls = []
    # n -> (xla, the kernel's one-row loop, its tiles) seconds
    chain = {2: (3.0, 2.0, 2.2), 3: (3.0, 2.5, 2.4), 4: (3.0, 3.5, 3.2), 5: (3.0, 1.0, 1.1), 6: (3.0, 3.5, 2.0)}

    def fake_time_chains(matrices, columns, repeats=7):
        calls.append(columns)
        return chain.get(columns, (1.0, 2.0, 2.5))

    def fake_time_decoding_steps():
        calls.append("step")
        return one_column

    monkeypatch.setattr(kernels, "_time_chains", fake_time_chains)
    monkeypatch.setattr(kernels, "_time_decoding_steps", fake_time_decoding_steps)
    # slower at 4 (by either loop) and from 7 on; at 6 by its tiles alone
    expected = {2, 3, 5, 6} | ({1} if one_column[1] < one_column[0] else set())
    try:
        kernels.small_product_columns.cache_clear()
        kernels.tiled_columns.cache_clear()
        assert kernels.small_product_columns() == expected
        assert kernels.tiled_columns() == {3, 6}  # where the tiles beat the one-row loop, of the columns served
        assert calls == ["step", *range(2, kernels.MAX_COLUMNS + 1)]
        kernels.small_product_columns.cache_clear()
        kernels.tiled_columns.cache_clear()
        assert kernels.small_product_columns() == expected and len(calls) == kernels.MAX_COLUMNS  # the file
        assert kernels.tiled_columns() == {3, 6}
        assert _custom_calls(6, tiles=True) == 1 and _custom_calls(5, tiles=False) == 1  # the forward follows them
        assert _custom_calls(6, jnp.bfloat16, kernels.BF16_PRODUCT_TARGET_NAME, tiles=True) == 1
    finally:
        kernels.small_product_columns.cache_clear()
        kernels.tiled_columns.cache_clear()


def test_the_one_column_probe_traces_each_variant_with_its_own_columns(monkeypatch):
    """`_time_decoding_steps` traces its two variants with the column counts it sets for its thread, whatever the
    process serves."""
    _kernel_or_skip()
    monkeypatch.setenv(kernels.ENV, "off")
    kernels.small_product_columns.cache_clear()
    try:
        assert _custom_calls(1) == 0
        for columns, served in [(frozenset({1}), 1), (frozenset(range(2, 17)), 0)]:
            kernels._tracing.columns = columns
            try:
                assert _custom_calls(1) == served and _custom_calls(2) == 1 - served
            finally:
                kernels._tracing.columns = None
        assert _custom_calls(1) == 0
    finally:
        kernels.small_product_columns.cache_clear()


def test_without_a_compiler_the_products_stay_with_xla(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_cpu_has_avx2_fma", lambda: True)
    why_not = kernels.load_kernel.__wrapped__()
    assert why_not is not None and "could not be built" in why_not and "no-such-compiler" in why_not


@pytest.mark.parametrize("b,t,k,g,h,s,lengths", [
    (1, 1, 3, 3, 64, 256, [40]),  # SmolLM2's decoding step
    (2, 3, 3, 3, 64, 64, [0, 64]),  # an empty row and a full one
    (3, 5, 2, 2, 16, 32, [7, 31, 1]),
    (2, 4, 1, 4, 12, 20, [5, 19]),  # a head size that is not a multiple of 8 (the scalar loops)
    (1, 2, 2, 4, 128, 48, [45]),  # two 64-lane passes over the values (Qwen's head size)
    (2, 3, 1, 2, 80, 40, [33, 17]),  # one 64-lane pass and a scalar remainder
    (16, 1, 3, 3, 64, 128, [108, 68, 81, 125, 21, 47, 89, 126, 35, 4, 67, 26, 61, 48, 89, 17]),
    (1, 7, 1, 1, 64, 32, [20]),  # with AVX-512: 7 queries as 3 + 3 + 1 over the keys, 6 + 1 over the values
    (1, 5, 2, 1, 64, 24, [10]),  # 3 + 2 over the keys, 5 over the values
    (2, 2, 2, 2, 128, 40, [33, 9]),  # 3 + 1 over the keys, 4 over the values, two 64-lane passes
])
def test_cache_attention_computes_the_models_attention(b, t, k, g, h, s, lengths):
    """The kernel against jaxspec.model._attention's own XLA path (computed in float64 by numpy here too), over
    ragged rows and a tree mask among the new tokens (each sees itself and a random subset of the others)."""
    _kernel_or_skip()
    from jaxspec.model import _attention

    rng = np.random.default_rng(b * 100 + t)
    q = rng.standard_normal((b, t, k * g, h), np.float32)  # [B, T, Hq, h]
    new_k, new_v = (rng.standard_normal((b, t, k, h), np.float32) for _ in range(2))  # [B, T, K, h]
    cache_k, cache_v = (rng.standard_normal((b, k, s, h), np.float32) for _ in range(2))  # [B, K, S, h]
    mask = (rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]  # [B, T, T]
    lengths = np.asarray(lengths, np.int32)  # [B]
    got = jax.jit(kernels.cache_attention)(jnp.asarray(q.reshape(b, t, k, g, h) / np.sqrt(h)), cache_k, cache_v,
                                           lengths, new_k, new_v, mask)  # [B, T, K, G, h]
    xla = _attention(*map(jnp.asarray, (q, new_k, new_v, cache_k, cache_v, lengths, mask)))  # [B, T, Hq, h]
    np.testing.assert_allclose(np.asarray(got).reshape(b, t, k * g, h), np.asarray(xla), rtol=0, atol=2e-6)
    # float64: the scores over the visible slots and new tokens, softmax, values
    q64 = q.reshape(b, t, k, g, h).astype(np.float64) / np.sqrt(h)
    for bi in range(b):
        keys = np.concatenate([cache_k[bi, :, :lengths[bi]], new_k[bi].transpose(1, 0, 2)], axis=1)  # [K, L + T, h]
        values = np.concatenate([cache_v[bi, :, :lengths[bi]], new_v[bi].transpose(1, 0, 2)], axis=1)
        scores = np.einsum("tkgh,ksh->tkgs", q64[bi], keys)  # [T, K, G, L + T]
        seen = np.concatenate([np.ones((t, lengths[bi]), bool), mask[bi]], axis=1)  # [T, L + T]
        scores = np.where(seen[:, None, None, :], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("tkgs,ksh->tkgh", probs / probs.sum(-1, keepdims=True), values)  # [T, K, G, h]
        np.testing.assert_allclose(np.asarray(got)[bi], want, rtol=0, atol=2e-6)


def test_the_per_layer_forward_runs_the_attention_kernel_unless_turned_off(monkeypatch, tiny_llama3):
    _kernel_or_skip()
    from jaxspec.cache import KVCache, init_cache
    from jaxspec.model import causal_mask, feature_major_layers, forward

    _, model, _ = tiny_llama3
    weights, cfg = feature_major_layers(model.weights), model.config
    cache = init_cache(cfg, 1, 16)
    cache = KVCache(k=tuple(cache.k), v=tuple(cache.v), lengths=cache.lengths)
    tokens, positions = jnp.ones((1, 2), jnp.int32), jnp.arange(2)[None]  # [1, 2]

    def calls() -> int:
        traced = jax.jit(lambda w, tok, pos, c: forward(w, cfg, tok, pos, c, causal_mask(1, 2)).logits)
        return traced.lower(weights, tokens, positions, cache).as_text().count(kernels.ATTENTION_TARGET_NAME)

    try:
        for setting, expected in [("on", cfg.num_layers), ("off", 0)]:
            monkeypatch.setenv(kernels.ATTENTION_ENV, setting)
            kernels.cache_attention_enabled.cache_clear()
            assert calls() == expected, setting
        monkeypatch.setenv(kernels.ATTENTION_ENV, "fast")
        kernels.cache_attention_enabled.cache_clear()
        with pytest.raises(UserError, match="JAXSPEC_CACHE_ATTENTION must be 'on'"):
            kernels.cache_attention_enabled()
    finally:
        kernels.cache_attention_enabled.cache_clear()


def test_cache_attention_broadcasts_a_shared_mask_and_refuses_shapes_that_do_not_fit():
    _kernel_or_skip()
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 3, 3, 2, 16), np.float32))  # [B, T, K, G, h]
    cache = jnp.asarray(rng.standard_normal((2, 3, 8, 16), np.float32))  # [B, K, S, h]
    new = jnp.asarray(rng.standard_normal((2, 3, 3, 16), np.float32))  # [B, T, K, h]
    lengths = jnp.asarray([2, 8], jnp.int32)
    tree = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # [T, T]: the third node's parent is the first
    shared = kernels.cache_attention(q, cache, cache, lengths, new, new, tree[None])
    each = kernels.cache_attention(q, cache, cache, lengths, new, new, jnp.broadcast_to(tree, (2, 3, 3)))
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(each))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.cache_attention(q, cache, cache, lengths[:1], new, new, tree[None])
