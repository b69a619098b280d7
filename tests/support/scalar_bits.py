"""The launch-scalar check shared by the CPU (reference gather) and CUDA (kernel) tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash.metal import backend

NUMPY_TYPES = {mx.int32: np.int32, mx.float32: np.float32}


def assert_scalars_keep_bits(values: list, dtype: mx.Dtype) -> None:
    """:func:`backend.launch_scalars` of ``values`` has their dtype, count and exact
    words (the host's float32 / int32 encoding, bit for bit)."""
    scalars = backend.launch_scalars(values, dtype)
    assert scalars.dtype == dtype and scalars.shape == (len(values),)
    want = np.asarray(values, dtype=NUMPY_TYPES[dtype]).view(np.int32)
    assert np.array_equal(np.array(scalars).view(np.int32), want)
