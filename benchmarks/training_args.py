"""Command-line options shared by the training benchmarks (``head_step.py``, ``train_throughput.py``).

Both compose a ``medusa-train`` config from a model and a data option, a batch size, a maximum length and extra
Hydra overrides; this module holds those options and the overrides they turn into, so the two scripts agree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def training_parser(doc: str, output_dir: str) -> argparse.ArgumentParser:
    """A parser with ``--model --data --batch-size --max-length --output-dir --threads --override``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260k", help="model/ config group option")
    parser.add_argument("--data", default="stories260k_selfdistill", help="data/ config group option")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--output-dir", type=Path, default=Path(output_dir))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    return parser


def training_overrides(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of the shared options (``--override`` last, so it wins); sets the thread count.

    Self-distilled data goes to ``OUTPUT_DIR/self_distill`` unless an ``--override`` names ``data.self_distill_dir``.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = [
        f"model={args.model}", f"data={args.data}", "trainer=cpu",
        f"trainer.per_device_train_batch_size={args.batch_size}", f"max_length={args.max_length}",
        "export=false", "overwrite=true",
    ]
    if not any(o.startswith("data.self_distill_dir=") for o in args.override):
        overrides.append(f"data.self_distill_dir={args.output_dir / 'self_distill'}")
    return [*overrides, *args.override]
