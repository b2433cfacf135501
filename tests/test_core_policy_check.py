"""One answer to "is this a policy?": ``lossscale_callbacks._policy.is_policy``, asked everywhere."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy, check_policy, is_policy
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.loop._logging_loop import LoggingLoop

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class LookAlike:
    """Has what the old duck-typed checks looked for, but none of a policy's validation."""

    constants: tuple = (1, 2.0, 0.5, 1, 1.0, 2.0**24)
    dynamic: bool = True

    def to_config(self) -> dict:
        return {"type": "dynamic"}


def test_policies_are_policies_and_look_alikes_are_not():
    assert is_policy(DynamicPolicy()) and is_policy(FixedPolicy(8.0))
    assert not any(is_policy(v) for v in (LookAlike(), None, "dynamic", {"type": "fixed", "scale": 8.0},
                                          DynamicPolicy, FixedPolicy))


def test_check_policy_names_the_argument_and_allows_none_only_when_asked():
    assert check_policy("policy", None) is None
    policy = FixedPolicy(2.0)
    assert check_policy("policy", policy, allow_none=False) is policy
    with pytest.raises(ValueError, match=r"^policy must be a DynamicPolicy or FixedPolicy, got None$"):
        check_policy("policy", None, allow_none=False)
    with pytest.raises(ValueError, match=r"^seed_policy must be None, a DynamicPolicy or FixedPolicy, got "
                                         r"LookAlike\("):
        check_policy("seed_policy", LookAlike())


def test_the_core_refuses_a_look_alike_everywhere():
    with pytest.raises(ValueError, match="policy must be"):
        LoggingLoop(LookAlike(), echo=None)
    with pytest.raises(ValueError, match="policy must be"):
        next_state(LookAlike(), initial_state(DynamicPolicy()), True)
    loop = LoggingLoop(None, echo=None)
    with pytest.raises(ValueError, match="policy must be"):
        loop.set_policy(LookAlike())


def test_torch_refuses_a_look_alike_as_policy_and_as_device():
    pytest.importorskip("torch")
    from lossscale_callbacks.torch._scaler import LossScaler

    with pytest.raises(ValueError, match="policy must be"):
        LossScaler("cpu", policy=LookAlike())
    with pytest.raises(ValueError, match=r"first argument is the device"):
        LossScaler(FixedPolicy(4.0))
    # A look-alike is not taken for a policy given in the device's place: torch says what is wrong.
    with pytest.raises((RuntimeError, TypeError, ValueError)) as info:
        LossScaler(LookAlike())
    assert "first argument is the device" not in str(info.value)


def _duck_checks(path: Path) -> list[str]:
    """``hasattr``/``getattr`` calls asking an object for a policy's ``constants`` or ``to_config``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ("constants", "to_config")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_answers_the_question_another_way():
    sources = [*(ROOT / "lossscale_callbacks").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]
    assert sources
    assert [hit for path in sources for hit in _duck_checks(path)] == []
