"""Tensor Core alignment checker and mixed-precision audit: check a model, or run the rules on a capture.

:func:`check_alignment` takes a Keras model or a torch module and runs its own framework's shape capture
(found through the ``lossscale_callbacks.checkers`` entry points, so nothing is imported until a model
is checked): the GEMMs and convolutions of one forward and backward pass, handed to :func:`analyze`,
the framework-free rules engine. Both return an :class:`AlignmentReport` of :class:`Finding` s.

The records a capture hands over, the GPU targets, the audit, the ``check`` and ``audit`` commands
(with the limits they apply before a model is loaded), the pytest plugin and each framework's capture
are private modules behind this face.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> report = check_alignment(model, torch.zeros(32, 50), dtype="float16")
    >>> [(f.layer, f.dimension, f.value, f.suggested) for f in report.findings]
    [('0', 'features_in', 50, 56)]
"""

from lossscale_callbacks.alignment._checkers import check_alignment
from lossscale_callbacks.alignment._report import AlignmentReport, Finding
from lossscale_callbacks.alignment._rules import NoRuleAppliedWarning, analyze

__all__ = ["AlignmentReport", "Finding", "NoRuleAppliedWarning", "analyze", "check_alignment"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
