"""What a schedule policy decided, as a comparable value (the Megatron and pipelining tests compare runs by it)."""

from __future__ import annotations

from typing import Any

__all__ = ["policy_decisions"]


def policy_decisions(policy: Any) -> tuple:
    """The policy's class, plan, the groups it copies (a device budget's choice) and the kept tails
    it learned (NOTE [Kept tail]); None for what a policy does not have."""
    plan = getattr(policy, "plan", None)
    return (
        type(policy).__name__,
        None if plan is None else plan.actions,
        getattr(policy, "offload_groups", None),
        getattr(policy, "copied_head", None),
        getattr(policy, "group_bytes", None),
    )
