"""Tensor Core alignment checker and mixed-precision audit: check a model, or run the rules on a capture.

:func:`check_alignment` takes a Keras model or a torch module and runs its own framework's shape capture
(found through the ``lossscale_callbacks.checkers`` entry points, so nothing is imported until a model
is checked): the GEMMs and convolutions of one forward and backward pass, handed to :func:`analyze`,
the framework-free rules engine. Both return an :class:`AlignmentReport` of :class:`Finding` s.

The pieces live in their modules: the records a capture hands over (``.records``: ``OpRecord``,
``ModelDim``, the ``Role``/``Pass``/``OpKind`` enums, ``FrameworkAdvice``), the GPU targets (``.targets``),
the audit (``.audit``), and each framework's capture (``lossscale_callbacks.keras.alignment``,
``lossscale_callbacks.torch.alignment``).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> report = check_alignment(model, torch.zeros(32, 50), dtype="float16")
    >>> [(f.layer, f.dimension, f.value, f.suggested) for f in report.findings]
    [('0', 'features_in', 50, 56)]
"""

from lossscale_callbacks.alignment.checkers import check_alignment
from lossscale_callbacks.alignment.report import AlignmentReport, Finding
from lossscale_callbacks.alignment.rules import NoRuleAppliedWarning, analyze

__all__ = ["AlignmentReport", "Finding", "NoRuleAppliedWarning", "analyze", "check_alignment"]
