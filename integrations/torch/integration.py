"""What an integration that builds on torch may use from :mod:`lossscale_callbacks.torch`.

Lightning, Fabric, Accelerate, the Transformers Trainer, Ray Train and Keras on its torch backend all
run on torch: they use the torch face (``LossScaler``, ``ScalerReader``) and this module, never the torch
integration's private modules, as every integration uses the core through its faces and the contract,
:mod:`lossscale_callbacks.integration`. ``tests/test_integration_contract.py`` keeps it so, and
``docs/adding_an_integration.md`` lists these names with the contract's.

Example:
    >>> from lossscale_callbacks.torch.integration import GRAD_SCALER_KEYS
    >>> GRAD_SCALER_KEYS[0]
    'scale'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossscale_callbacks.integration import lazy_attributes

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from lossscale_callbacks.torch._deepspeed_reader import has_deepspeed_scaler
    from lossscale_callbacks.torch._grad_scaler_compat import GRAD_SCALER_KEYS
    from lossscale_callbacks.torch._ledger import check_replay, ledger_capture
    from lossscale_callbacks.torch._ops import TorchOps
    from lossscale_callbacks.torch._reader import warn_no_scaler
    from lossscale_callbacks.torch._replay import loss_of_output
    from lossscale_callbacks.torch._step_monitor import ScalerStepMonitor

# section -> {name: (the module that defines it, what an integration uses it for: one line)}.
_CONTRACT: dict[str, dict[str, tuple[str, str]]] = {
    "For integrations that build on torch": {
        "ScalerStepMonitor": ("torch._step_monitor",
                              "The monitor of a hand-written torch loop, written once: subclass it and count "
                              "the steps."),
        "warn_no_scaler": ("torch._reader", "The one warning of a monitor that finds no scaler to read."),
        "has_deepspeed_scaler": ("torch._deepspeed_reader",
                                 "Whether an engine, its optimizer or a scaler has a DeepSpeed scaler."),
        "GRAD_SCALER_KEYS": ("torch._grad_scaler_compat",
                             "The keys of a torch.amp.GradScaler state dict (LossScaler writes them too)."),
        "TorchOps": ("torch._ops", "The update rule's ops on torch tensors (float32 scale, int64 counters)."),
        "ledger_capture": ("torch._ledger",
                           "A LossScaler's ledger capture (after track()): feed it batches and samplers."),
        "check_replay": ("torch._ledger",
                         "The replay argument checked: False, True or replays per log interval."),
        "loss_of_output": ("torch._replay",
                           "The loss in what a training step returned: a tensor, or a mapping's loss."),
    },
}

__all__ = ["GRAD_SCALER_KEYS", "ScalerStepMonitor", "TorchOps", "check_replay", "has_deepspeed_scaler",
           "ledger_capture", "loss_of_output", "warn_no_scaler"]

_MODULES = {name: f"lossscale_callbacks.{module}" for entries in _CONTRACT.values()
            for name, (module, _) in entries.items()}
__getattr__ = lazy_attributes(__name__, _MODULES)


def __dir__() -> list[str]:
    """The contract only: the modules behind it stay out of ``dir()``."""
    return list(__all__)
