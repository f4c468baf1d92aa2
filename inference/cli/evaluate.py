"""``medusa-eval export_dir=DIR prompts=FILE output_dir=OUT decoders=[vanilla,medusa] dtype=... max_new_tokens=N``.

Runs the chosen decoders in turn over the prompts and writes ``OUT/results.jsonl``, ``OUT/summary.json``,
``OUT/summary.md`` and PNG plots (see :mod:`inference.evaluation.evaluate`). Settings: ``conf/evaluate.yaml``
(:class:`~inference.evaluation.config.EvaluateConfig`) and ``conf/decoder/<name>.yaml``. With ``-m`` each run of a
sweep writes into ``OUT/<job number>`` and the sweep ends with one table of all runs (``OUT/sweep.md``).
"""

from __future__ import annotations

from omegaconf import DictConfig

import medusa_train  # noqa: F401  (registers config schemas and resolvers)
import inference.evaluation.config  # noqa: F401  (registers evaluate_schema and schema/decoder/*)
from medusa_train.cli.app import hydra_app


def run(cfg: DictConfig) -> dict:
    from inference.evaluation.evaluate import evaluate

    return evaluate(cfg)


@hydra_app("evaluate", example='medusa-eval export_dir=runs/stories/export output_dir=runs/stories/eval')
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
