"""``medusa-eval export_dir=DIR prompts=FILE output_dir=OUT decoders=[vanilla,medusa] dtype=... max_new_tokens=N``.

Runs the chosen decoders in turn over the prompts and writes ``OUT/results.jsonl``, ``OUT/summary.json``,
``OUT/summary.md`` and PNG plots (see :mod:`inference.evaluation.eval_run`). Settings: ``conf/evaluate.yaml``
(:class:`~inference.evaluation.eval_config.EvaluateConfig`) and ``conf/decoder/<name>.yaml``. With ``-m`` each run of a
sweep writes into ``OUT/<job number>`` and the sweep ends with one table of all runs (``OUT/sweep.md``).
"""

from __future__ import annotations

from omegaconf import DictConfig

from inference.evaluation.eval_config import register_evaluate_schema
from inference.registry import register_decoder_schemas
from inference.conf import CONF_DIR
from medusa_train.cli.app import hydra_app, register_shared_schemas


def register_schemas() -> None:
    """What ``conf/evaluate.yaml`` composes from: ``evaluate_schema``, ``schema/decoder/<name>``, the shared schemas
    and resolvers (idempotent)."""
    register_shared_schemas()
    register_decoder_schemas()
    register_evaluate_schema()


def run(cfg: DictConfig) -> dict:
    from inference.evaluation.eval_run import evaluate

    return evaluate(cfg)


@hydra_app("evaluate", example='medusa-eval export_dir=runs/stories/export output_dir=runs/stories/eval',
           register_schemas=register_schemas, conf_dir=CONF_DIR)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
