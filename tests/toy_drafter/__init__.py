"""A drafter type defined by the tests alone, the checklist of ``docs/architecture.md`` ("Adding a drafter") done once:
one folder (this one: its module, :mod:`tests.toy_drafter.heads`, and this catalog entry), one preset
(``conf/heads/repeat.yaml``) and one catalog entry (:data:`REPEAT`). Its tree drafter is Medusa's, imported from
Medusa's folder: its heads, like Medusa's, all read the last committed position at once. It has no engine layout.

The entry is not registered on import: a test registers it for its own duration
(:func:`medusa_train.catalog.registered`), with :data:`PRESETS` on Hydra's search path (``heads=repeat``).
"""

from __future__ import annotations

from pathlib import Path

from medusa_train.catalog import DrafterType
from medusa_train.drafters.medusa.proposer import MedusaTreeDrafter
from tests.toy_drafter.heads import RepeatHeads, RepeatSpec, repeat_logits

PRESETS = Path(__file__).resolve().parent / "conf"  # holds heads/repeat.yaml

REPEAT = DrafterType(
    name="repeat", title="Repeat", spec_cls=RepeatSpec, module_cls=RepeatHeads, logits=repeat_logits,
    source="this test", weights_file="repeat_heads.safetensors",
    config_keys={"num_heads": "repeat_num_heads", "num_layers": "repeat_num_layers"},
    tree_drafter=MedusaTreeDrafter,  # heads computed at once, read per tree level
)

__all__ = ["PRESETS", "REPEAT"]
