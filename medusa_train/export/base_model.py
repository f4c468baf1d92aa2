"""The fine-tuned base model of a Medusa-2 export, saved beside the heads as an ordinary HF model folder.

Medusa-2 changes the base model (LoRA adapters merged into its weights, or all of them trained), and the heads only
fit that base. The export therefore holds it:

```
export/
  config.json          base_model_name_or_path: "base" (relative to the export folder), plus the heads' fields
  medusa_lm_head.safetensors, vllm/, ...
  base/                config.json, model.safetensors, generation_config.json, tokenizer files
```

``base/`` is what engines load as the target model (vLLM ``--model export/base --speculative-model export/vllm``,
TGI, transformers' ``from_pretrained``); :func:`medusa_train.loading.export.load_export` finds it through the relative
path. The folder is written into a temporary sibling and swapped into place whole
(:func:`medusa_train.files.folders.publish_folder`), so a killed export leaves the old ``base/`` or the new one, never
half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from medusa_train.export.files import FULL_WAYS_OUT, set_default_modes, storage_bytes
from medusa_train.files.folders import publish_folder
from medusa_train.runs.disk_space import disk_full_named

BASE_DIR = "base"


def save_base_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, export_dir: str | os.PathLike[str],
    name: str = BASE_DIR,
) -> Path:
    """Save ``model`` (a plain ``*ForCausalLM``: adapters already merged) and ``tokenizer`` to ``export_dir/name``.

    Returns:
        The folder written.

    Raises:
        ValueError: ``model`` still holds peft adapters (merge them first with ``merge_and_unload()``).
        DiskFullError: no room for the model's weights (their bytes named; a lower bound of the folder's size); the
            old ``base/`` is left as it was.
    """
    if hasattr(model, "peft_config") or hasattr(model, "disable_adapter"):
        raise ValueError("save_base_model needs a model without adapters: call merge_and_unload() first")
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / name

    def write(stage: Path) -> None:
        with disk_full_named(stage, storage_bytes(model.state_dict().values()),
                             f"the fine-tuned base model {name}/ (at least its weights' bytes)", FULL_WAYS_OUT):
            model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
        set_default_modes(stage)  # safetensors writes 0o600: a shared export needs the default modes

    publish_folder(target, write, replace=True)
    return target
