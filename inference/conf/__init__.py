"""``inference``'s Hydra presets: the primary configs of ``medusa-eval`` (``evaluate.yaml``), ``medusa-generate``
(``generate.yaml``) and ``medusa-tune-tree`` (``tune_tree.yaml``), and the groups only they compose: ``decoder/``
(one file per decoder) and ``draft/`` (the draft model of the draft-model decoders). The groups they share with
training (``model/``, the schemas) stay in ``medusa_train/conf``, found through each primary's ``hydra.searchpath``
(:data:`SHARED_CONF`)."""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent
SHARED_CONF = "pkg://medusa_train.conf"  # medusa_train's presets (model/, ...), on every primary's search path
