"""Counts what a load reads from safetensors checkpoints and sends to devices (tests of sharded loading)."""

from __future__ import annotations

import contextlib

import jax
import numpy as np


@contextlib.contextmanager
def counting_checkpoint_reads():
    """Within the block, `safetensors.safe_open` counts the bytes of every tensor block read (`get_slice`, `get_tensor`)
    and `jax.device_put` the bytes of host arrays it sends. Yields the counts: read, placed, and most_ahead (the most
    bytes read and not yet placed at any time)."""
    import safetensors

    count = {"read": 0, "placed": 0, "most_ahead": 0}
    real_open, real_put = safetensors.safe_open, jax.device_put

    def counted(block):
        count["read"] += block.nbytes
        count["most_ahead"] = max(count["most_ahead"], count["read"] - count["placed"])
        return block

    class CountingSlice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            return counted(self.inner[index])

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return CountingSlice(self.inner.get_slice(name))

        def get_tensor(self, name):
            return counted(self.inner.get_tensor(name))

    def counting_put(x, *args, **kwargs):
        if isinstance(x, np.ndarray):
            count["placed"] += x.nbytes
        return real_put(x, *args, **kwargs)

    safetensors.safe_open, jax.device_put = CountingFile, counting_put
    try:
        yield count
    finally:
        safetensors.safe_open, jax.device_put = real_open, real_put
