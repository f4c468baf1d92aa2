"""The memory plan of training a drafter for a target model, per stage, before anything loads (planned from
parameter counts and shapes on the ``meta`` device: no weights, no GPU; not measured).

Examples::

    python benchmarks/memory_plan.py --config ../shared/assets/configs/llama-3.1-70b.json --heads medusa \
        --gpus 8 --gpu-gib 80 --seq 4096
    python benchmarks/memory_plan.py --config .../llama-3.1-8b.json --heads eagle3 --gpus 8 --gpu-gib 141 \
        --seq 4096 --tokens 200000000 --trainer deepspeed_zero2

The heads and trainer settings are the shipped presets' (``conf/heads/{medusa1,medusa2,hydra,eagle3}.yaml``,
``conf/trainer/<--trainer>.yaml``), with the flags given on top. When they do not fit, the script prints why (stage,
bytes needed and available) and plans again with the fewest setting changes that fit
(:func:`medusa_train.planning.find_fix`), unless ``--no-fix``. The last line is a JSON object: ``fits`` and
``peak_gib_per_gpu`` of the plan printed last, ``changes`` (the overrides it needed, empty when the given settings
fit), ``as_given`` (the given settings' fit and peak) and the per-stage figures.

A bad flag or config is refused before any planning with one line on stderr naming the flag as typed and the fix,
exit status 2: a number out of its range (:data:`BOUNDS`; ``--gpu-gib nan``, ``--host-gib 0``), ``--seq`` beyond the
config's ``max_position_embeddings``, a ``--config`` path that does not exist (never read as a Hub id), or a config
without the size fields the plan reads (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``vocab_size``: transformers would fill its defaults and plan another model).
"""

from __future__ import annotations

import argparse
import json
import sys

from medusa_train.config.bounds import MAX_COUNT, Bound
from medusa_train.cli.flags import FlagParser, check_flags, refuse, schema_bound
from medusa_train.config.schema import DataConfig, HeadsConfig, TrainConfig, TrainerConfig
from medusa_train.files.paths import CONF_DIR
from medusa_train.planning import (
    GIB,
    PlanSettings,
    build_plan,
    find_fix,
    heads_preset,
    load_target_config,
    trainer_preset,
    zero_stage_of,
)
from medusa_train.planning.meta import CONTEXT_FIELD, raw_config, stored_context
from medusa_train.planning.settings import dtype_bytes

HEADS = {"medusa": "medusa1", "hydra": "hydra", "eagle3": "eagle3"}  # --heads -> conf/heads/ (medusa2: --recipe)
MAX_GIB = float(1 << 20)  # a GPU's or a host's memory, GiB: a PiB, far above any machine, below a typo such as 1e12
MAX_CACHE_TOKENS = 1 << 50  # tokens in the hidden cache: far above any data set (ShareGPT: about 10^8)
# each numeric flag's range, stated once (a flag that sets a config field takes that field's bound)
BOUNDS = {
    "gpus": Bound(1, cap=MAX_COUNT, hint="the run's GPUs, its world size"),
    "gpu_gib": Bound(0, low_open=True, cap=MAX_GIB, hint="memory of one GPU in GiB, e.g. 80"),
    "seq": schema_bound(TrainConfig, "max_length"),
    "gpus_per_host": Bound(1, cap=MAX_COUNT, hint="GPUs of one host, at most --gpus"),
    "host_gib": Bound(0, low_open=True, cap=MAX_GIB, hint="RAM of one host in GiB; leave the flag out not to check it"),
    "batch": schema_bound(TrainerConfig, "per_device_train_batch_size"),
    "loss_chunk_size": schema_bound(TrainerConfig, "loss_chunk_size"),
    "num_heads": schema_bound(HeadsConfig, "num_heads"),
    "head_vocab_size": schema_bound(HeadsConfig, "head_vocab_size"),
    "tokens": Bound(1, cap=MAX_CACHE_TOKENS, hint="tokens the hidden cache stores"),
    "max_num_seqs": schema_bound(DataConfig, "generation_batch_size"),
}
# the config fields the planner's errors name -> the flag that sets each here
FIELDS = {"heads.head_vocab_size": "--head-vocab-size", "heads.num_heads": "--num-heads",
          "trainer.per_device_train_batch_size": "--batch", "trainer.loss_chunk_size": "--loss-chunk-size",
          "data.generation_batch_size": "--max-num-seqs", "model.dtype": "--dtype"}


def build_parser() -> FlagParser:
    p = FlagParser(prog="memory_plan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the target's config.json (or a local model folder)")
    p.add_argument("--heads", choices=sorted(HEADS), required=True)
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run (its world size)")
    p.add_argument("--gpu-gib", type=float, required=True, help="memory of one GPU, GiB (80 for an A100/H100 80GB)")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence (max_length)")
    p.add_argument("--gpus-per-host", type=int, default=None, help="default: min(gpus, 8)")
    p.add_argument("--host-gib", type=float, default=None, help="RAM of one host, GiB (default: not checked)")
    p.add_argument("--trainer", default="ddp", choices=sorted(f.stem for f in (CONF_DIR / "trainer").glob("*.yaml")),
                   help="conf/trainer/ preset (ddp, deepspeed_zero2, deepspeed_zero3)")
    p.add_argument("--recipe", choices=("medusa1", "medusa2"), default="medusa1",
                   help="medusa2: joint training (Medusa heads only), the base ZeRO-3-sharded with LoRA")
    p.add_argument("--batch", type=int, default=None, help="per_device_train_batch_size (default: the preset's)")
    p.add_argument("--loss-chunk-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--dtype", default=None, help="the base's dtype (default: the config's torch_dtype)")
    p.add_argument("--num-heads", type=int, default=None, help="heads.num_heads (default: the preset's)")
    p.add_argument("--share-lm-head", action="store_true", help="heads.share_lm_head=true")
    p.add_argument("--head-vocab-size", type=int, default=None, help="heads.head_vocab_size (default: the preset's)")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the hidden cache (for its disk bytes)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (data.generation_batch_size; default: its default)")
    p.add_argument("--no-self-distill", action="store_true", help="no vLLM self-distillation stage")
    p.add_argument("--no-cache", action="store_true", help="train on the base's forward pass, no hidden cache")
    p.add_argument("--no-fix", action="store_true", help="plan the given settings only")
    p.add_argument("--brief", action="store_true", help="stage totals only, no terms")
    return p


def parse(argv: list[str] | None = None) -> tuple[FlagParser, argparse.Namespace]:
    """The parser and the flags, each checked (one line and exit status 2 on a bad one)."""
    p = build_parser()
    args = p.parse_args(argv)
    check_flags(p, args, BOUNDS)
    if args.gpus_per_host is not None and args.gpus_per_host > args.gpus:
        p.error(f"--gpus-per-host {args.gpus_per_host} is more than --gpus {args.gpus}: give at most --gpus")
    if args.recipe == "medusa2" and args.heads != "medusa":
        p.error(f"--recipe medusa2 trains Medusa heads (heads.mode=joint), not --heads {args.heads}: give "
                "--heads medusa, or leave --recipe out")
    if args.dtype is not None:
        try:
            dtype_bytes(args.dtype, "--dtype")
        except ValueError as e:
            p.error(str(e))
    return p, args


def main(argv: list[str] | None = None) -> int:
    """Print the plan (and a fix), the last line JSON; 0. A bad flag or config: one line on stderr, exit status 2."""
    p, args = parse(argv)
    try:
        target_config = load_target_config(args.config)
        context = stored_context(target_config, raw_config(args.config))
    except (OSError, ValueError) as e:
        p.error(f"--config {e}" if str(e).startswith(str(args.config)) else f"--config {args.config}: {e}")
    if context is not None and args.seq > context:
        p.error(f"--seq {args.seq} is beyond the target's context ({CONTEXT_FIELD}={context} in {args.config}): "
                f"give --seq {context} or less")
    try:
        return plan(args, target_config)
    except ValueError as e:
        refuse(p, str(e), FIELDS)


def plan(args: argparse.Namespace, target_config: object) -> int:
    """Plan the flags' run on ``target_config``, print it (and the fewest changes that fit); 0.

    Raises:
        ValueError: settings the heads or trainer presets refuse (naming the config field).
    """
    heads_overrides = {k: v for k, v in (("medusa_num_heads", args.num_heads),
                                         ("head_vocab_size", args.head_vocab_size)) if v is not None}
    if args.share_lm_head:
        heads_overrides["share_lm_head"] = True
    heads_name = "medusa2" if args.recipe == "medusa2" and args.heads == "medusa" else HEADS[args.heads]
    heads = heads_preset(heads_name, **heads_overrides)
    trainer = trainer_preset(args.trainer, **{k: v for k, v in (("per_device_train_batch_size", args.batch),
                                                               ("loss_chunk_size", args.loss_chunk_size))
                                              if v is not None})
    dtype = args.dtype or str(getattr(target_config, "dtype", None) or "bfloat16").removeprefix("torch.")
    settings = PlanSettings(
        gpus=args.gpus, gpu_bytes=int(args.gpu_gib * GIB), seq=args.seq, batch=trainer.per_device_train_batch_size,
        gpus_per_host=args.gpus_per_host, host_bytes=None if args.host_gib is None else int(args.host_gib * GIB),
        base_dtype=dtype, precision=trainer.precision, zero_stage=zero_stage_of(trainer),
        loss_chunk_size=trainer.loss_chunk_size, recipe=heads.mode, hidden_cache=not args.no_cache,
        self_distill=not args.no_self_distill, tokens=args.tokens,
        max_num_seqs=args.max_num_seqs or DataConfig().generation_batch_size,
        lora_r=heads.lora.r if heads.finetune == "lora" else (None if heads.finetune == "full" else 0),
    )
    given = build_plan(target_config, heads, settings)
    print(f"# {args.config}: {heads_name} heads, trainer={args.trainer}, {args.gpus} x {args.gpu_gib:g} GiB, "
          f"seq {args.seq} (planned from shapes, not measured)")
    print(given.table(terms=not args.brief))
    final, changes = given, ()
    if not given.fits:
        for stage, where, need, have in given.problems():
            print(f"! {stage.name}: needs {need / GIB:.2f} GiB per {where}, {have / GIB:.2f} GiB available")
        fix = None if args.no_fix else find_fix(target_config, heads, settings)
        if fix is None:
            print("! no setting among trainer presets, heads.share_lm_head, batch size, loss chunk or more GPUs "
                  "(up to 512) fits" if not args.no_fix else "! --no-fix: the given settings only")
        else:
            final, changes = fix.plan, fix.changes
            print(f"\n# the given settings do not fit; with {' '.join(changes)} (overrides medusa-train accepts) "
                  "they do:")
            print(final.table(terms=not args.brief))
    record = {**final.as_dict(), "changes": list(changes),
              "as_given": {"fits": given.fits, "peak_gib_per_gpu": round(given.peak_gpu_bytes / GIB, 3),
                           "failing": sorted({p[0].name for p in given.problems()})}}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
