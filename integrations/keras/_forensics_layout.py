"""Which layer each of a Keras optimizer's variables belongs to, with the layers in the model's forward order.

Overflow forensics count per layer, and name where an overflow started: the flagged layer nearest the
loss, i.e. the last flagged one in forward order. So the layout holds the layers in the order they
stand in the model (``model.layers``, nested models depth first: the order Keras builds and calls them),
and maps gradients to layers **by variable**, never by position: ``apply(grads, variables)`` may pass
the variables in any order, or only some of them (a layer frozen and the model recompiled with the same
optimizer), and each gradient still lands on its own layer.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"),
    ...                           keras.layers.Dense(2, name="out")])
    >>> layout = ForensicsLayout.of(model.trainable_variables, model)
    >>> layout.layers
    ('hidden', 'out')
    >>> layout.positions(model.trainable_variables[::-1])  # by variable: reversed order, reversed ids
    ((1, 1, 0, 0), (3, 2, 1, 0))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lossscale_callbacks.integration import layer_of


def _default_key(variable: Any) -> int:
    return id(variable)


def model_layer_paths(model: Any) -> dict[int, str]:
    """``id(variable) -> layer path`` for every trainable variable a layer of ``model`` owns, in forward
    order: the model's layers in their order, nested ones depth first (``encoder/dense``)."""
    owner: dict[int, str] = {}

    def visit(layer: Any, prefix: str) -> None:
        for sub in getattr(layer, "_layers", None) or getattr(layer, "layers", None) or ():
            path = f"{prefix}{sub.name}"
            # A layer's own variables (not its sublayers'); frozen ones too, so a layout outlives a freeze.
            for weight in getattr(sub, "_trainable_variables", None) or sub.trainable_weights:
                owner.setdefault(id(weight), path)
            visit(sub, path + "/")

    visit(model, "")
    return owner


class ForensicsLayout:
    """An optimizer's variables mapped onto layers in forward order (see the module docstring).

    Args:
        layers: the layers, in forward order.
        keys: each optimizer variable's key (``optimizer._var_key``), in the optimizer's order.
        layer_ids: each optimizer variable's layer (an index into ``layers``), in the same order.
        sizes: each optimizer variable's number of values.
        key: how to key a variable passed to :meth:`positions` (``optimizer._var_key``).
    """

    def __init__(self, layers: Sequence[str], keys: Sequence[Any], layer_ids: Sequence[int],
                 sizes: Sequence[int], key: Callable[[Any], Any] = _default_key) -> None:
        self.layers = tuple(layers)
        self.sizes = tuple(int(s) for s in sizes)
        self._key = key
        self._index = {k: i for i, k in enumerate(keys)}
        self._layer_ids = tuple(int(i) for i in layer_ids)

    @classmethod
    def of(cls, variables: Sequence[Any], model: Any = None,
           key: Callable[[Any], Any] = _default_key) -> ForensicsLayout:
        """The layout of ``variables`` (an optimizer's, in its order), named after ``model``'s layers.

        Variables no layer of ``model`` owns (or all, without a model) are named from their path
        (``dense_1/kernel`` → ``dense_1``) and come after the model's layers, in the optimizer's order.
        """
        owners = model_layer_paths(model) if model is not None else {}
        named = [owners.get(id(v)) or layer_of(str(getattr(v, "path", None) or getattr(v, "name", "variable"))
                                                .split(":")[0], "/") for v in variables]
        forward = {path: i for i, path in enumerate(dict.fromkeys(owners.values()))}
        first = {name: i for i, name in reversed(list(enumerate(named)))}
        layers = sorted(first, key=lambda n: (forward.get(n, len(forward)), first[n]))
        position = {name: i for i, name in enumerate(layers)}
        return cls(layers, [key(v) for v in variables], [position[n] for n in named],
                   [int(np.prod(v.shape)) for v in variables], key)

    def positions(self, variables: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(layer ids, optimizer indices)`` of ``variables``, one each per variable, by identity.

        Raises:
            ValueError: a variable the optimizer was not built with (as Keras' own check says).
        """
        indices = []
        for variable in variables:
            index = self._index.get(self._key(variable))
            if index is None:
                raise ValueError(f"Unknown variable: {variable}. This optimizer can only be called for the "
                                 "variables it was originally built with.")
            indices.append(index)
        return tuple(self._layer_ids[i] for i in indices), tuple(indices)

    def layer_sizes(self, seen: Sequence[int]) -> dict[str, int]:
        """Per layer, the values of the optimizer variables flagged in ``seen`` (one 0/1 per variable)."""
        totals: dict[str, int] = {}
        for layer_id, size, flag in zip(self._layer_ids, self.sizes, seen, strict=True):
            if flag:
                name = self.layers[layer_id]
                totals[name] = totals.get(name, 0) + size
        return totals
