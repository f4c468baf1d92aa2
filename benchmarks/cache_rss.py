"""Peak memory of building the hidden-state cache at 1x and 4x the quickstart's data: the build streams, so it
should not grow with the data.

Each size is built in a fresh subprocess (so one size's pages do not count for the other) that loads
SmolLM2-135M-Instruct (``conf/model/smollm2_135m.yaml``), tokenizes ``--conversations x scale`` ShareGPT conversations
at ``--max-length`` tokens (the quickstart's ``max_length=320``; it trains on the replies the base regenerates for
about 520 of the 700 conversations it reads, here ShareGPT's own replies stand in for them: the cache holds the same
number of tokens) and runs :func:`~medusa_train.training.hidden_cache.build_hidden_cache` into a fresh folder, its
base argmax projected ``--argmax-chunk-size`` positions at a time (the recipes pass ``trainer.loss_chunk_size``). The
child reports its peak resident set during the build (``VmHWM`` in ``/proc/self/status``, reset through
``/proc/self/clear_refs`` once the model and data are loaded, so loading ShareGPT does not count), its resident set
before the build, the peak while loading, the tokens cached and the build's seconds.

    python benchmarks/cache_rss.py                       # 1x and 4x, the full 30-layer model (CPU: tens of minutes)
    python benchmarks/cache_rss.py --layers 2            # the first 2 decoder layers only: same H, same bytes cached

``--layers`` keeps the first decoder layers only: the cache's size (tokens x H x bytes) and so the memory a
non-streaming build would hold are the same, the forward passes are cheaper. The last line printed is JSON:
``{"rss_mib": {"1": ..., "4": ...}, "build_mib": {...}, "load_peak_mib": {...}, "tokens": {...}, "seconds": {...},
"ratio": rss 4x / 1x}`` (``build_mib``: the build's peak less the resident set before it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from medusa_train.config.schema import TrainerConfig


def vm_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from hydra import compose, initialize_config_dir

    from medusa_train.cli.app import register_shared_schemas
    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.data import Collator, build_dataset, load_conversations
    from medusa_train.loading.base import load_base_model
    from medusa_train.files.paths import CONF_DIR
    from medusa_train.training.hidden_cache import build_hidden_cache
    from medusa_train.training.step import FrozenBase

    torch.set_num_threads(args.threads)
    register_shared_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("model/smollm2_135m", overrides=[f"model.dtype={args.dtype}", "model.device=cpu"]).model
    base, tokenizer = load_base_model(as_dataclass(ModelConfig, node))
    if args.layers:
        base.model.layers = base.model.layers[: args.layers]
        base.config.num_hidden_layers = args.layers
    conversations, _ = load_conversations("sharegpt", max_conversations=args.conversations * args.scale)
    dataset, _, _ = build_dataset(tokenizer, conversations, args.max_length, 0.0, 0)
    del conversations
    process_peak = vm_kib("VmHWM")  # loading the model and the data
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS: the peak below is the build's
    before = vm_kib("VmRSS")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        build_hidden_cache(FrozenBase.of(base), dataset, folder, split="train", fingerprint="0" * 16,
                           collator=Collator.from_tokenizer(tokenizer), batch_size=args.batch_size,
                           argmax_chunk_size=args.argmax_chunk_size)
        seconds = time.perf_counter() - start
        peak = vm_kib("VmHWM")
    return {"rss_mib": peak / 1024, "build_mib": (peak - before) / 1024, "load_peak_mib": process_peak / 1024,
            "tokens": int(sum(len(r) for r in dataset["input_ids"])), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=520, help="conversations at 1x (the quickstart's)")
    parser.add_argument("--max-length", type=int, default=320, help="tokens kept per conversation")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--batch-size", type=int, default=8, help="rows per base forward pass")
    parser.add_argument("--argmax-chunk-size", type=int, default=TrainerConfig.loss_chunk_size,
                        help="positions projected onto the vocabulary at once for the cache's base argmax (the "
                             "recipes pass trainer.loss_chunk_size, this default; 0: the whole batch at once)")
    parser.add_argument("--dtype", default="float32", help="the base's dtype (the quickstart trains in fp32)")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--folder", default=None, help="where the caches go (a temporary folder, removed)")
    parser.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results: dict[str, dict[str, float]] = {}
    for scale in args.scales:
        command = [sys.executable, __file__, "--child", "--scale", str(scale), "--conversations",
                   str(args.conversations), "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
                   "--argmax-chunk-size", str(args.argmax_chunk_size), "--dtype", args.dtype,
                   "--layers", str(args.layers), "--threads", str(args.threads)]
        if args.folder:
            command += ["--folder", args.folder]
        done = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
        results[str(scale)] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{scale}x: {results[str(scale)]}", file=sys.stderr)
    summary = {key: {s: round(r[key], 1) for s, r in results.items()}
               for key in ("rss_mib", "build_mib", "load_peak_mib", "tokens", "seconds")}
    scales = [str(s) for s in args.scales]
    summary["ratio"] = round(results[scales[-1]]["rss_mib"] / results[scales[0]]["rss_mib"], 3)
    summary["settings"] = {"layers": args.layers or "all", "dtype": args.dtype, "max_length": args.max_length,
                           "conversations_1x": args.conversations, "batch_size": args.batch_size}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
