"""The CPU kernel for products with a few columns (jaxspec/kernels): its results against numpy in float64, where
the per-layer forward calls it, and how the number of columns it serves is chosen."""

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
    """Odd row counts and inner sizes that are not a multiple of 8 (the vector loop's tail) included."""
    _kernel_or_skip()
    rng = np.random.default_rng(out)
    w = rng.standard_normal((out, inner), np.float32)  # [out, in]
    product = jax.jit(kernels.kernel_product)
    for n in range(1, kernels.MAX_COLUMNS + 1):
        x = rng.standard_normal((inner, n), np.float32)  # [in, N]
        got = np.asarray(product(jnp.asarray(w), jnp.asarray(x)))  # [out, N]
        want = w.astype(np.float64) @ x.astype(np.float64)
        assert got.shape == (out, n)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(inner) * np.abs(want).max())


def _custom_calls(columns: int) -> int:
    w = jnp.ones((32, 16), jnp.float32)  # [out, in]
    x = jnp.ones((16, columns), jnp.float32)  # [in, N]
    traced = jax.jit(lambda w, x: kernels.feature_major_product(w, x))  # a new function: traced afresh
    return traced.lower(w, x).as_text().count(kernels.TARGET_NAME)


def test_feature_major_products_use_the_kernel_for_the_columns_chosen(monkeypatch):
    _kernel_or_skip()
    try:
        for setting, served in [("16", range(2, 17)), ("3", range(2, 4)), ("off", ())]:
            monkeypatch.setenv(kernels.ENV, setting)
            kernels.small_product_columns.cache_clear()
            for n in range(1, 19):
                assert _custom_calls(n) == (1 if n in served else 0), (setting, n)
        monkeypatch.setenv(kernels.ENV, "seventeen")
        kernels.small_product_columns.cache_clear()
        with pytest.raises(UserError, match="column count from 2 to 16"):
            kernels.small_product_columns()
    finally:
        kernels.small_product_columns.cache_clear()


def test_the_columns_are_measured_once_and_cached(monkeypatch, tmp_path):
    """Unset, the column counts are those at which the kernel was faster, measured once (the timing here replaced
    by a made-up one) and read back from the cache file after."""
    _kernel_or_skip()
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernels.ENV, "auto")
    calls = []
    chain = {2: (3.0, 2.0), 3: (3.0, 2.5), 4: (3.0, 3.5), 5: (3.0, 1.0)}  # n -> (xla, kernel) seconds

    def fake_time_chains(matrices, columns, repeats=7):
        calls.append(columns)
        return chain.get(columns, (1.0, 2.0))

    monkeypatch.setattr(kernels, "_time_chains", fake_time_chains)
    try:
        kernels.small_product_columns.cache_clear()
        assert kernels.small_product_columns() == {2, 3, 5}  # slower at 4 and from 6 on
        assert calls == list(range(2, kernels.MAX_COLUMNS + 1))
        kernels.small_product_columns.cache_clear()
        assert kernels.small_product_columns() == {2, 3, 5} and len(calls) == kernels.MAX_COLUMNS - 1  # the file
    finally:
        kernels.small_product_columns.cache_clear()


def test_without_a_compiler_the_products_stay_with_xla(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_cpu_has_avx2_fma", lambda: True)
    why_not = kernels.load_kernel.__wrapped__()
    assert why_not is not None and "could not be built" in why_not and "no-such-compiler" in why_not
