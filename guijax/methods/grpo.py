"""GRPO: train on each task's on-policy group as it is (BEPA Eq. 4-5, ARPO §3.4 without replay)."""
from __future__ import annotations

from guijax.methods.base import Method


class GRPO(Method):
    name = "grpo"
    summary = "GRPO on the on-policy groups"
