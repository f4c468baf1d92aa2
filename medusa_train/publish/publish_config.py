"""Config schema of ``medusa-publish`` (``conf/publish.yaml``).

There is deliberately no ``token`` field: Hydra writes every override into its logs, so the token comes only from the
environment (``HF_TOKEN``) or the login stored by ``hf auth login``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class PublishConfig:
    """``medusa-publish export_dir=DIR repo_id=NAME`` (or ``dry_run=true output_dir=OUT``).

    Attributes:
        export_dir: the export folder (``config.json`` + ``medusa_lm_head.safetensors``, tree and ``vllm/``).
        repo_id: ``namespace/name`` of the Hub repository; created when missing. Optional with ``dry_run`` (the card
            then shows a placeholder).
        dry_run: write the repository folder to ``output_dir`` and upload nothing.
        output_dir: where ``dry_run`` writes the folder (must be empty or absent).
        private: create the repository private; an existing repository keeps its visibility.
        revision: branch to publish to (created from ``main`` when missing).
        eval_dir: a ``medusa-eval`` output folder (``summary.json``, ``summary.md``, plots); default
            ``${export_dir}/eval`` when that exists.
        license: license of the published heads; default: the base model's (its model card), else ``unknown``.
        base_model: Hub id of the base model, for exports trained on a local copy (a folder, a GGUF or llama2.c
            file): written as ``base_model_name_or_path`` in the published ``config.json`` and the card. For a
            Medusa-2 export (its own fine-tuned ``base/``) it names the model ``base/`` was fine-tuned from
            (``original_base_model_name_or_path``); the heads keep loading ``base/``.
        commit_message: first line of the commits (default: one naming medusa-train).
    """

    export_dir: str = MISSING
    repo_id: Optional[str] = None
    dry_run: bool = False
    output_dir: Optional[str] = None
    private: bool = False
    revision: Optional[str] = None
    eval_dir: Optional[str] = None
    license: Optional[str] = None
    base_model: Optional[str] = None
    commit_message: Optional[str] = None

    def validate(self) -> None:
        """Raise ``ValueError`` for a combination that cannot run, or a ``repo_id`` / ``base_model`` the Hub would
        not take as a name (checked before any file is read)."""
        if self.dry_run and not self.output_dir:
            raise ValueError("dry_run=true writes the repository folder to output_dir: set output_dir=OUT")
        if not self.dry_run and not self.repo_id:
            raise ValueError("repo_id is required to publish (e.g. repo_id=your-name/medusa-heads); "
                             "or preview the folder with dry_run=true output_dir=OUT")
        if self.output_dir and not self.dry_run:
            raise ValueError("output_dir is only used with dry_run=true; add dry_run=true or drop output_dir")
        from medusa_train.publish.pipeline import check_base_model
        from medusa_train.publish.upload import check_repo_id

        if self.repo_id is not None:
            check_repo_id(self.repo_id)
        check_base_model(self.base_model)


def register_publish_schema() -> None:
    """Store :class:`PublishConfig` as ``publish_schema`` (``conf/publish.yaml`` extends it; idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="publish_schema", node=PublishConfig)
