"""Holding step-interval LR schedulers on skipped optimizer steps, settled once when training is set up.

Why a wrapper around the scheduler: Lightning 2.x has no notion of a skipped optimizer step. After
every optimizer step its training loop (``_TrainingEpochLoop._update_learning_rates``) steps every
step-interval scheduler through the LightningModule's ``lr_scheduler_step`` hook; the value
``optimizer_step`` returns is not looked at, the scheduler config has no condition to set, and the
hook belongs to the user's module. The one place where Lightning hands a precision plugin the
schedulers is ``Precision.connect(model, optimizers, lr_scheduler_configs)``, whose returned
configs the strategy keeps for the run. So the plugin hands back, once at setup, the schedulers it
may have to hold wrapped in :class:`HeldLRScheduler`, and puts the user's own objects back at
teardown (:func:`release`); nothing of the user's (module, hook, scheduler) is patched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


class HeldLRScheduler:
    """A scheduler whose ``step()`` is swallowed once for every skipped optimizer step.

    Everything else is the wrapped scheduler's: ``state_dict()``/``load_state_dict()`` (checkpoints
    hold only the user's scheduler state), ``optimizer``, ``get_last_lr()``, attributes read or set.
    While a Trainer with ``LossScalePlugin(hold_lr_schedulers=True)`` fits, this is what
    ``trainer.lr_scheduler_configs[i].scheduler``, ``LightningModule.lr_schedulers()`` and the
    ``lr_scheduler_step`` hook see for step-interval schedulers; the user's own scheduler is
    :attr:`scheduler`.

    Args:
        scheduler: the user's scheduler (a ``torch.optim.lr_scheduler.LRScheduler``,
            ``ReduceLROnPlateau`` or anything with ``step``/``state_dict``/``load_state_dict``).
        on_hold: called each time a step is swallowed (the plugin counts its ``lr_scheduler_lag``).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> held = HeldLRScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        ...                        on_hold=lambda: None)
        >>> held.hold(); held.step(); held.get_last_lr()    # after a skipped optimizer step: held
        [1.0]
        >>> opt.step(); held.step(); held.get_last_lr()     # after an applied one: stepped
        [0.5]
    """

    __slots__ = ("_on_hold", "pending", "scheduler")

    def __init__(self, scheduler: Any, on_hold: Callable[[], None]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_on_hold", on_hold)
        # Scheduler steps still to be swallowed: one per skipped optimizer step not yet followed by
        # Lightning's scheduler step.
        object.__setattr__(self, "pending", 0)

    def hold(self) -> None:
        """The optimizer's last step was skipped: swallow this scheduler's next ``step()``."""
        object.__setattr__(self, "pending", self.pending + 1)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pending:
            object.__setattr__(self, "pending", self.pending - 1)
            self._on_hold()
            return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in HeldLRScheduler.__slots__:  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    # Copies and pickles set the wrapper's own slots, not the scheduler's attributes.
    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in HeldLRScheduler.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"HeldLRScheduler({self.scheduler!r}, pending={self.pending})"


def wrap(configs: Iterable[Any], holdable: Callable[[Any], bool], on_hold: Callable[[], None]
         ) -> tuple[list[Any], list[tuple[Any, HeldLRScheduler]]]:
    """Lightning's scheduler configs with each ``holdable`` one's scheduler wrapped.

    Returns the configs to hand back from ``connect`` (new config objects where a scheduler was
    wrapped; the given ones are left as they are) and the ``(config, wrapper)`` pairs to
    :func:`release` at teardown.
    """
    configs_out, held = [], []
    for config in configs:
        if holdable(config):
            wrapper = HeldLRScheduler(config.scheduler, on_hold)
            config = dataclasses.replace(config, scheduler=wrapper)
            held.append((config, wrapper))
        configs_out.append(config)
    return configs_out, held


def release(held: Iterable[tuple[Any, HeldLRScheduler]]) -> None:
    """Put the user's schedulers back into the configs :func:`wrap` made."""
    for config, wrapper in held:
        config.scheduler = wrapper.scheduler
