"""``medusa-export-gguf export_dir=DIR``: the export's EAGLE-3 drafter as a GGUF that llama.cpp loads beside the
target's GGUF (``DIR/llamacpp/eagle3_drafter.gguf``), written by llama.cpp's own converter
(:func:`medusa_train.drafters.eagle3.gguf.export_eagle3_gguf`; ``bash launch/install_llamacpp.sh`` installs it). The
target's HF folder the converter reads (config, tokenizer) is the export's recorded base model, or ``model=...``; a
GGUF base is converted into an HF folder under the cache first (:func:`medusa_train.loading.base.engine_model_path`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from medusa_train.cli.app import hydra_app, register_shared_schemas


@dataclass
class ExportGgufConfig:
    """``medusa-export-gguf export_dir=DIR [model=NAME] [outtype=f32] [force=false]``.

    Attributes:
        export_dir: an EAGLE-3 export written with ``export_vllm=true`` (its ``speculators/``).
        model: optional ``model/`` config overriding the base model recorded in the export (the converter's
            ``--target-model-dir``).
        outtype: the drafter's weight type in the GGUF: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        force: convert even when ``llamacpp/eagle3_drafter.json`` records the same speculators files and outtype.
    """

    export_dir: str = MISSING
    model: Optional[Any] = None
    outtype: str = "f32"
    force: bool = False

    def validate(self) -> None:
        """Checks that need no file: ``outtype`` (before the export or llama.cpp's install is looked at).

        Raises:
            ValueError: ``outtype`` not one of :data:`~medusa_train.engines.llamacpp_env.OUTTYPES`.
        """
        from medusa_train.engines.llamacpp_env import OUTTYPES

        if self.outtype not in OUTTYPES:
            raise ValueError(f"outtype={self.outtype!r}: choose one of {', '.join(OUTTYPES)}")


def register_schemas() -> None:
    """What ``conf/export_gguf.yaml`` composes from: ``export_gguf_schema`` and the shared schemas (idempotent)."""
    from hydra.core.config_store import ConfigStore

    register_shared_schemas()
    ConfigStore.instance().store(name="export_gguf_schema", node=ExportGgufConfig)


def run(cfg: DictConfig) -> str:
    """Check the settings (``outtype``), the export (a folder medusa-train wrote, with ``speculators/``) and
    llama.cpp's install, in that order; convert, print the GGUF's path and return it.

    Raises:
        ValueError: an unknown ``outtype``, or a speculators config llama.cpp cannot take.
        FileNotFoundError: ``export_dir`` is no such folder or no export, or has no ``speculators/``.
        LlamaCppUnavailable: llama.cpp not installed (checked after the settings and the export).
    """
    from medusa_train.config.schema import as_dataclass
    from medusa_train.drafters.eagle3.gguf import export_eagle3_gguf, speculators_files
    from medusa_train.engines.llamacpp_env import converter_command
    from medusa_train.export.files import check_export_dir
    from medusa_train.export.reader import read_export_config
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.export import export_base_config

    ec: ExportGgufConfig = as_dataclass(ExportGgufConfig, cfg)  # outtype checked first (validate)
    check_export_dir(ec.export_dir)
    speculators_files(ec.export_dir)  # refused before a base model is converted
    converter_command()
    target = engine_model_path(export_base_config(ec.export_dir, read_export_config(ec.export_dir), ec.model))
    path = str(export_eagle3_gguf(ec.export_dir, target, ec.outtype, force=ec.force))
    print(path)
    return path


@hydra_app("export_gguf", example="medusa-export-gguf export_dir=runs/quickstart/eagle3/export",
           register_schemas=register_schemas)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
