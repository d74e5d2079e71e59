"""jaxspec: speculative decoding for LLMs in JAX, every method on one static-shape, lossless core."""

import os

# transformers is used for configs and tokenizers only; its "PyTorch was not found" advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxspec.cache import KVCache, init_cache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.generate import generate, generate_tokens, stream_generate
from jaxspec.loading import LoadedModel, load_model
from jaxspec.model import Weights, forward
from jaxspec.sampling import SamplingConfig

__all__ = [
    "KVCache", "LoadedModel", "ModelConfig", "SamplingConfig", "UserError", "Weights",
    "forward", "generate", "generate_tokens", "init_cache", "load_model", "stream_generate",
]
