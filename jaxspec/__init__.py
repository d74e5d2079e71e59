"""jaxspec: speculative decoding for LLMs in JAX, every method on one static-shape, lossless core."""

import os

# transformers is used for configs and tokenizers only; its "PyTorch was not found" advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxspec.cache import KVCache, init_cache  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.errors import UserError  # noqa: E402
from jaxspec.generate import generate, generate_tokens, stream_generate  # noqa: E402
from jaxspec.loading import LoadedModel, load_model  # noqa: E402
from jaxspec.model import Weights, forward  # noqa: E402
from jaxspec.sampling import SamplingConfig  # noqa: E402

__all__ = [
    "KVCache", "LoadedModel", "ModelConfig", "SamplingConfig", "UserError", "Weights",
    "forward", "generate", "generate_tokens", "init_cache", "load_model", "stream_generate",
]
