"""EAGLE-3 drafters (Li et al. 2025, arXiv:2503.01840): one decoder layer fed by three target layers and the next
token's embedding, trained by the training-time test.

The folder holds the drafter and its loss logits (:mod:`~medusa_train.drafters.eagle3.drafter`), its own setting
``heads.feature_layers`` (:mod:`~medusa_train.drafters.eagle3.options`), its tree drafter with a KV cache of its own,
over static or EAGLE-2 dynamic trees (:mod:`~medusa_train.drafters.eagle3.proposer`), its export writer for vLLM
(``speculators/``, :mod:`~medusa_train.drafters.eagle3.speculators`), its vLLM mapping and decoder
(:mod:`~medusa_train.drafters.eagle3.vllm`), its llama.cpp conversion (:mod:`~medusa_train.drafters.eagle3.gguf`) and
decoder (:mod:`~medusa_train.drafters.eagle3.llamacpp`).
Its export is the ``state_dict`` layout (``eagle3_drafter.safetensors``). This module is the catalog entry.
"""

from __future__ import annotations

from medusa_train.models.catalog import DrafterType, register
from medusa_train.drafters.eagle3.drafter import (
    Eagle3Drafter,
    Eagle3Spec,
    eagle3_features,
    eagle3_logits,
    eagle3_target_fields,
)
from medusa_train.drafters.eagle3.gguf import export_eagle3_gguf
from medusa_train.drafters.eagle3.llamacpp import LLAMACPP_DECODER
from medusa_train.drafters.eagle3.options import Eagle3Options
from medusa_train.drafters.eagle3.proposer import Eagle3TreeDrafter
from medusa_train.drafters.eagle3.speculators import FILES as SPECULATORS_FILES
from medusa_train.drafters.eagle3.speculators import speculators_writer
from medusa_train.drafters.eagle3.vllm import VLLM_DECODER, VLLM_METHOD, speculative_config

EAGLE3 = register(DrafterType(
    name="eagle3", title="EAGLE-3", spec_cls=Eagle3Spec, module_cls=Eagle3Drafter, logits=eagle3_logits,
    projected=eagle3_logits,
    source="Li et al. 2025, EAGLE-3, arXiv:2503.01840, Sec. 3",
    features_of=eagle3_features, target_fields=lambda config, options: eagle3_target_fields(
        config, options.get("feature_layers")),
    options=Eagle3Options, reads_path=True, sequence=True, weights_file="eagle3_drafter.safetensors",
    config_keys={"num_heads": "eagle3_num_steps", "num_layers": "eagle3_num_layers",
                 "feature_layers": "eagle3_feature_layers",
                 "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
                 "head_dim": "head_dim", "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
                 "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings"},
    engines={"fasterdecoding": "EAGLE-3 drafters have no FasterDecoding form (FasterDecoding loads Medusa heads)",
             "tgi": "EAGLE-3 drafters have no TGI layout here",
             "vllm": None},
    engine_writers={"vllm": speculators_writer},  # speculators/, not vllm/
    engine_files=SPECULATORS_FILES,
    tree_drafter=Eagle3TreeDrafter,
    vllm_method=VLLM_METHOD, vllm_config=speculative_config,
    llamacpp_gguf=export_eagle3_gguf,
    engine_decoders=(VLLM_DECODER, LLAMACPP_DECODER),
))

__all__ = ["EAGLE3"]
