"""``medusa-publish export_dir=DIR repo_id=NAME``: publish an export to the Hub (``dry_run=true output_dir=OUT``:
write the repository folder only). Settings: :class:`medusa_train.publish.publish_config.PublishConfig`."""

from __future__ import annotations

from omegaconf import DictConfig

from medusa_train.cli.app import hydra_app, register_shared_schemas
from medusa_train.config.schema import as_dataclass
from medusa_train.publish.publish_config import PublishConfig, register_publish_schema


def register_schemas() -> None:
    """What ``conf/publish.yaml`` composes from: ``publish_schema`` (:class:`PublishConfig`), the shared schemas and
    resolvers (idempotent)."""
    register_shared_schemas()
    register_publish_schema()


def run(cfg: DictConfig) -> object:
    """Validate the config, then publish or write the folder; prints where the result went."""
    from medusa_train.publish import prepare_repo_folder, publish_export

    pc: PublishConfig = as_dataclass(PublishConfig, cfg)
    common = dict(eval_dir=pc.eval_dir, license=pc.license, base_model=pc.base_model)
    if pc.dry_run:
        result = prepare_repo_folder(pc.export_dir, pc.output_dir, pc.repo_id, **common)
        print(f"wrote {len(result.files)} files to {result.folder} (dry run: nothing uploaded)")
    else:
        result = publish_export(pc.export_dir, pc.repo_id, private=pc.private, revision=pc.revision,
                                commit_message=pc.commit_message, **common)
        print(f"published {len(result.files)} files to {result.url}")
    for path in result.files:
        print(f"  {path}")
    for note in result.missing:
        print(f"missing: {note}")
    return result


@hydra_app("publish", example='medusa-publish export_dir=runs/stories/export repo_id=your-name/stories-medusa',
           register_schemas=register_schemas)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
