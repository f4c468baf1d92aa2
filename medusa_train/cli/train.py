"""``medusa-train``: train Medusa heads (Hydra app over ``conf/train.yaml``).

Examples::

    medusa-train model=stories260k output_dir=runs/stories            # offline, CPU, a few minutes
    medusa-train model=smollm2_135m data=sharegpt data.max_conversations=2000 output_dir=runs/smol
    torchrun --nproc_per_node=8 -m medusa_train.cli.train trainer=ddp model=vicuna_7b data=sharegpt output_dir=...
    medusa-train ... resume=true                                       # continue from the latest complete checkpoint

Under the deepspeed launcher the ``--local_rank=N`` argument it appends is moved into ``LOCAL_RANK`` before Hydra
parses the command line. ``output_dir`` is checked (:class:`CheckOutputDir`) before Hydra creates its run folder
inside it, so a bad one (empty, a file, someone else's folder) leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from medusa_train.cli.app import RefuseBeforeRun, hydra_app, register_shared_schemas


def register_schemas() -> None:
    """What ``conf/train.yaml`` composes from: the shared schemas and resolvers (idempotent)."""
    register_shared_schemas()


def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local_rank N`` (deepspeed launcher) from ``argv``, setting ``LOCAL_RANK``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ["LOCAL_RANK"] = argv[i + 1]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


class CheckOutputDir(RefuseBeforeRun):
    """Hydra callback (``hydra.callbacks`` in ``conf/train.yaml``): refuse a bad ``output_dir`` before Hydra makes
    ``${output_dir}/hydra``, with the one-line message of :func:`~medusa_train.training.run_dir.check_location`
    (:class:`~medusa_train.cli.app.RefuseBeforeRun`), for a run and a sweep."""

    def __init__(self) -> None:
        super().__init__("medusa_train.training.run_dir.check_location", "output_dir", "medusa-train", multirun=True)


@hydra_app("train", example='medusa-train model=stories260k output_dir=runs/stories',
           register_schemas=register_schemas)
def _main(cfg: DictConfig) -> None:
    if int(os.environ.get("RANK", "0")) > 0:  # one voice in the console: other ranks log warnings only
        logging.getLogger().setLevel(logging.WARNING)
    from hydra.core.hydra_config import HydraConfig

    from medusa_train.config.auto_trainer import log_choice

    log_choice(HydraConfig.get().runtime.choices.get("trainer"))
    train(cfg)


def train(cfg: Any) -> dict[str, Any]:
    """One ``medusa-train`` run: the recipe of ``heads.mode`` (:data:`~medusa_train.training.recipe.RECIPES`:
    Medusa-1 or Medusa-2), refused before any weight loads when its memory plan does not fit
    (:func:`~medusa_train.planning.run_check.check_run_memory`), then with ``push_to_hub=true`` the upload of its
    export (rank 0), the repository and token checked before any model loads.

    Returns:
        The recipe's summary, with ``hub_url`` when the export was published.

    Raises:
        ValueError: invalid settings, or a stage the memory plan says cannot fit (the setting to change named).
            PublishError: ``push_to_hub=true`` without a usable token or repository (before training), or a failed
            upload (the export is kept; the message gives the ``medusa-publish`` command).
    """
    from medusa_train.planning.run_check import check_run_memory
    from medusa_train.publish import check_publish_ready
    from medusa_train.training.process_group import explain_timeout
    from medusa_train.training.recipe import build_recipe

    recipe = build_recipe(cfg)  # every setting checked
    plan = check_run_memory(recipe.cfg, recipe.env.world_size)  # before any weight loads or the folder changes
    if plan is not None:  # recorded beside the measured peak in the export's training record
        recipe.summary["planned_peak_device_bytes"] = plan.peak_gpu_bytes
    hub = recipe.cfg.push_to_hub
    if hub:
        check_publish_ready(recipe.cfg.hub_repo_id)  # repo name, offline mode and token
    with explain_timeout(recipe.cfg.trainer.timeout_minutes):  # a rank that waited too long says which setting
        summary = recipe.run()
    if hub and recipe.env.is_main and summary.get("export_dir"):
        summary["hub_url"] = publish(Path(summary["export_dir"]), recipe.cfg.hub_repo_id, recipe.cfg.hub_private,
                                     recipe.cfg.hub_revision)
    return summary


def publish(export_dir: Path, repo_id: str, private: bool, revision: str | None) -> str:
    """Upload the finished export; returns its URL. A failure keeps the export and says how to retry."""
    from medusa_train.publish import PublishError, publish_export

    try:
        result = publish_export(export_dir, repo_id, private=private, revision=revision)
    except PublishError as e:
        raise PublishError(f"{e}\nThe export is saved in {export_dir}; retry with "
                           f"`medusa-publish export_dir={export_dir} repo_id={repo_id}`") from None
    print(f"published {export_dir} to {result.url}", flush=True)
    return result.url


def main() -> None:
    sys.argv = strip_local_rank(sys.argv)
    _main()


if __name__ == "__main__":
    main()
