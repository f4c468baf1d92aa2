"""Medusa heads (Cai et al. 2024, arXiv:2401.10774): K residual MLPs on the target's last hidden state.

The folder holds the heads and their loss logits (:mod:`~medusa_train.drafters.medusa.heads`), their tree drafter
(:mod:`~medusa_train.drafters.medusa.proposer`) and their vLLM mapping and decoder
(:mod:`~medusa_train.drafters.medusa.vllm`).
Their export is the ``medusa`` layout, FasterDecoding's keys that FasterDecoding, TGI and vLLM load, written and read
by :mod:`medusa_train.export` (which also reads FasterDecoding's and vLLM's own folders); the shared spec and head
vocabulary are :mod:`medusa_train.models.heads_base`'s. This module is the catalog entry.
"""

from __future__ import annotations

from medusa_train.models.catalog import MEDUSA_LAYOUT, DrafterType, register
from medusa_train.drafters.medusa.heads import MedusaHeads, medusa_logits
from medusa_train.drafters.medusa.proposer import MedusaTreeDrafter
from medusa_train.drafters.medusa.vllm import VLLM_DECODER, VLLM_METHOD, speculative_config
from medusa_train.models.heads_base import HeadsSpec

MEDUSA = register(DrafterType(
    name="medusa", title="Medusa", spec_cls=HeadsSpec, module_cls=MedusaHeads, logits=medusa_logits,
    projected=medusa_logits,
    source="Cai et al. 2024, Medusa, arXiv:2401.10774, Sec. 2.1.1, Eq. (1)",
    joint=True, layout=MEDUSA_LAYOUT, config_keys={"num_heads": "medusa_num_heads", "num_layers": "medusa_num_layers"},
    engines={"fasterdecoding": None, "tgi": None, "vllm": None},
    tree_drafter=MedusaTreeDrafter,
    vllm_method=VLLM_METHOD, vllm_config=speculative_config, engine_decoders=(VLLM_DECODER,),
))

__all__ = ["MEDUSA"]
