"""Drafters: one module per method family, all on the interface of `jaxspec.drafters.base`."""

from jaxspec.drafters.base import ChainDrafter, Drafter, RoundInputs, draft_chain
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.early_exit import EarlyExitDrafter
from jaxspec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = [
    "ChainDrafter", "DraftModelDrafter", "Drafter", "EarlyExitDrafter", "PromptLookupDrafter", "RoundInputs",
    "draft_chain",
]
