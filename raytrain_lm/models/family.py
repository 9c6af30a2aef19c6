"""What a model is, torch-free: `ModelConfig`, the `model.` settings, one flat dataclass
composed of what each family's folder declares (models/base.py's ModelShape, every family's;
models/gpt/'s GPTSettings, models/llama/'s LlamaSettings, which the Llama-like families share,
models/moe/'s MoESettings) and the parametrization's; and `FAMILIES`, the families by
`model.arch`, listed once here (models/__init__.py builds and imports through them).

A new model setting: in its family's settings class (its folder's `__init__.py`); one that every
family reads: ModelShape. A new family: its folder (settings, Family, decoder), one entry below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.base import Family, ModelShape, ParamCounts, TPPlan, positive_settings
from raytrain_lm.models.gpt import GPTFamily, GPTSettings
from raytrain_lm.models.llama import LlamaFamily
from raytrain_lm.models.mistral import MistralFamily
from raytrain_lm.models.moe import MoEFamily, MoESettings
from raytrain_lm.models.qwen2 import Qwen2Family
from raytrain_lm.models.qwen3 import Qwen3Family
from raytrain_lm.setting import setting

__all__ = ["FAMILIES", "Family", "ModelConfig", "ModelShape", "ParamCounts", "TPPlan", "family",
           "positive_settings"]


@dataclass
class ModelConfig(MoESettings, GPTSettings):
    """Every family's settings, flat (fields in ModelShape's, the GPT's, the Llama skeleton's,
    the mixture of experts', then the parametrization's order)."""
    # The parametrization (models/mup.py): how initial values, multipliers and Adam's learning
    # rates scale with the width.
    param: str = setting("sp", help="sp (standard: the best lr moves as the model widens) or mup "
                         "(maximal update: tune a narrow proxy, train the wide model at its lr; "
                         "docs/tuning.md).")
    mup_base_width: Optional[int] = setting(None, help="mup: the width whose learning rates and "
                                            "initial values the model keeps (the proxy's; at it "
                                            "mup is sp) [default: n_embd].")
    mup_zero_init: bool = setting(False, help="mup: the query projection (GPT's c_attn query "
                                  "rows) and an untied output head start at zero, as the muP "
                                  "paper recommends (`mup`'s readout_zero_init); a tied head is "
                                  "the embedding and keeps its draws.")
    init_std: float = setting(0.02, help="The std of the matrices' and embeddings' initial "
                              "normal draws (GPT-2's 0.02; the residual projections' is it / "
                              "sqrt(2 n_layer)); under mup, the base width's (it transfers).")

    @property
    def hidden_dim(self) -> int:
        """The MLP's hidden size, as this config's family computes it."""
        return family(self).hidden_dim(self)


FAMILIES: dict[str, Family] = {f.name: f for f in (GPTFamily(), LlamaFamily(), Qwen2Family(),
                                                   Qwen3Family(), MistralFamily(), MoEFamily())}


def family(m: ModelShape | str) -> Family:
    """The family of a config (or of an arch name); an unknown one is the user's to fix."""
    arch = m if isinstance(m, str) else m.arch
    if arch not in FAMILIES:
        raise UserError(f"model.arch must be one of {', '.join(FAMILIES)}, got {arch!r}")
    return FAMILIES[arch]
