"""One report per (framework, zoo case), computed once per test session and shared by the test modules."""

from __future__ import annotations

import functools

from .expected import CASES


@functools.cache
def torch_report(name: str):
    from lossscale_callbacks.torch._alignment import check_alignment

    from . import torch_zoo

    case = CASES[name]
    model, sample = torch_zoo.build(name)
    return check_alignment(model, sample, dtype=case.precision, tf32=case.tf32)


@functools.cache
def keras_report(name: str):
    import keras

    from lossscale_callbacks.keras._alignment import check_alignment

    from . import keras_zoo

    case = CASES[name]
    previous = keras.config.dtype_policy()
    # The global policy is process-wide: set it only while the model is built, always restore it.
    keras.config.set_dtype_policy("mixed_float16" if case.precision == "float16" else "float32")
    try:
        model = keras_zoo.build(name)
    finally:
        keras.config.set_dtype_policy(previous)
    return check_alignment(model, batch_size=case.batch, tf32=case.tf32)
