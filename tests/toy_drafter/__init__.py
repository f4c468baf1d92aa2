"""A drafter type defined by the tests alone, the checklist of ``docs/architecture.md`` ("Adding a drafter") done once:
one folder (this one: its module, :mod:`tests.toy_drafter.heads`; its own option ``heads.scale`` and its check,
:mod:`tests.toy_drafter.options`; its engine files, vLLM mapping and engine decoder ``vllm_repeat``,
:mod:`tests.toy_drafter.serving`; and this catalog entry), one preset (``conf/heads/repeat.yaml``) and one catalog
line (its package among :data:`medusa_train.models.catalog.BUILTIN_MODULES`). Its tree drafter is Medusa's, imported from
Medusa's folder: its heads, like Medusa's, all read the last committed position at once. No real engine serves it: the
tests serve it with a fake one (:mod:`tests.toy_drafter.fake_engine`).

Importing this package registers the type, as a built-in folder's does; a test adds the package to the catalog's
modules for its own duration (``tests/medusa_train/test_toy_drafter.py``), with :data:`PRESETS` on Hydra's search path
(``heads=repeat``).
"""

from __future__ import annotations

from pathlib import Path

from medusa_train.models.catalog import DrafterType, register
from medusa_train.drafters.medusa.proposer import MedusaTreeDrafter
from tests.toy_drafter.heads import RepeatHeads, RepeatSpec, repeat_logits
from tests.toy_drafter.options import RepeatOptions
from tests.toy_drafter.serving import ENGINE_DIR, VLLM_DECODER, VLLM_METHOD, repeat_vllm_writer, speculative_config

PRESETS = Path(__file__).resolve().parent / "conf"  # holds heads/repeat.yaml

REPEAT = register(DrafterType(
    name="repeat", title="Repeat", spec_cls=RepeatSpec, module_cls=RepeatHeads, logits=repeat_logits,
    source="this test", options=RepeatOptions, weights_file="repeat_heads.safetensors",
    config_keys={"num_heads": "repeat_num_heads", "num_layers": "repeat_num_layers", "scale": "repeat_scale"},
    engines={"vllm": None}, engine_writers={"vllm": repeat_vllm_writer}, engine_files=(ENGINE_DIR,),
    tree_drafter=MedusaTreeDrafter,  # heads computed at once, read per tree level
    vllm_method=VLLM_METHOD, vllm_config=speculative_config, engine_decoders=(VLLM_DECODER,),
))

__all__ = ["PRESETS", "REPEAT"]
