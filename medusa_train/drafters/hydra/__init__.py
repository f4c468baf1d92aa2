"""Hydra heads (Ankner et al. 2024, arXiv:2402.05109): draft heads that also read the candidate path's tokens.

The folder holds the heads and their loss logits (:mod:`~medusa_train.drafters.hydra.heads`), their own setting
``heads.combine`` (:mod:`~medusa_train.drafters.hydra.options`) and their tree drafter, level by level
(:mod:`~medusa_train.drafters.hydra.proposer`). Their export is the ``state_dict`` layout
(``hydra_heads.safetensors``); no engine serves them (the reasons are in the entry). This module is the catalog entry.
"""

from __future__ import annotations

from medusa_train.models.catalog import DrafterType, register
from medusa_train.drafters.hydra.heads import HydraHeads, HydraSpec, hydra_logits, hydra_projected
from medusa_train.drafters.hydra.options import HydraOptions
from medusa_train.drafters.hydra.proposer import HydraTreeDrafter

HYDRA = register(DrafterType(
    name="hydra", title="Hydra", spec_cls=HydraSpec, module_cls=HydraHeads, logits=hydra_logits,
    projected=hydra_projected,
    source="Ankner et al. 2024, Hydra, arXiv:2402.05109, Sec. 3",
    options=HydraOptions, reads_path=True, weights_file="hydra_heads.safetensors",
    config_keys={"num_heads": "hydra_num_heads", "num_layers": "hydra_num_layers", "combine": "hydra_combine"},
    engines={"fasterdecoding": "Hydra heads have no FasterDecoding form",
             "tgi": "Hydra heads have no TGI layout (TGI's Medusa loader reads Medusa heads only)",
             "vllm": "vLLM's Medusa loader reads Medusa heads only"},
    tree_drafter=HydraTreeDrafter,
))

__all__ = ["HYDRA"]
