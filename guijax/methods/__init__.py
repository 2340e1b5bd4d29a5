"""Training methods, one unit each, registered by name. The pipeline trains any of them through the
`Method` interface (guijax/methods/base.py); adding one means its own module plus a line here."""
from __future__ import annotations

import difflib

import ml_collections

from guijax.methods.arpo import ARPO
from guijax.methods.base import Context, Hook, IdentityHook, Method
from guijax.methods.bepa import BEPA, Level1Only, Level2Only
from guijax.methods.evocua import EvoCUA, EvoCUACycle, EvoCUADPO, EvoCUARFT
from guijax.methods.expert_mix import LUFFY, RLPlusSFT, TraceReplacement
from guijax.methods.expert_sft import SFT, SFTThenRL
from guijax.methods.grpo import GRPO
from guijax.methods.offline import DPO, KTO, RFT
from guijax.methods.seagent import SEAgent
from guijax.methods.seagent_s2g import SpecialistToGeneralist
from guijax.methods.sgcd import SGCD, SGCDFullSupervision, SGCDNoContinuations
from guijax.methods.step0 import STEP0, FinalStepGRPO

REGISTRY: dict[str, type[Method]] = {m.name: m for m in (
    GRPO, ARPO, BEPA, Level1Only, Level2Only, TraceReplacement, LUFFY, RLPlusSFT, SFT, SFTThenRL, RFT, DPO, KTO,
    EvoCUARFT, EvoCUADPO, EvoCUA, EvoCUACycle, SGCD, SGCDNoContinuations, SGCDFullSupervision, SEAgent,
    SpecialistToGeneralist, STEP0, FinalStepGRPO)}


def option_sections() -> dict[str, type]:
    """{config section: its dataclass} over every registered method (methods may share one section)."""
    sections: dict[str, type] = {}
    for cls in REGISTRY.values():
        if cls.section is not None:
            if sections.setdefault(cls.section, cls.options_class) is not cls.options_class:
                raise TypeError(f"methods declare section {cls.section!r} with different option classes")
    return sections


def method_names() -> list[str]:
    return sorted(REGISTRY)


def get_method(name: str, config: ml_collections.ConfigDict, key: str = "method") -> Method:
    """The method `name` on `config`, validated; an unknown name fails naming `key` and the nearest names."""
    if name not in REGISTRY:
        near = difflib.get_close_matches(name, REGISTRY, n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise ValueError(f"unknown method {name!r} in {key}{hint} (registered: {', '.join(method_names())})")
    method = REGISTRY[name](config)
    method.validate()
    return method


__all__ = ["Context", "Hook", "IdentityHook", "Method", "REGISTRY", "get_method", "method_names", "option_sections"]
