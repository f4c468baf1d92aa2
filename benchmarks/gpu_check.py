"""The steps of ``launch/gpu_check.sh`` that are Python, and the one table it prints at the end.

    python benchmarks/gpu_check.py inputs DIR                    # a tiny Llama + tokenizer + conversations, offline
    python benchmarks/gpu_check.py exact --device cuda --out F   # tree decoding's greedy output = plain greedy's
    python benchmarks/gpu_check.py speed --config C --device cuda --out F   # plain vs tree tokens/s, random weights
    python benchmarks/gpu_check.py memory --device cuda --inputs DIR --out F  # the plan against a measured run
    python benchmarks/gpu_check.py report DIR                    # the table of a finished check's folder

Everything is built here from a config: no Hub, no download, no SmolLM2 (the GPU machine has no network). The tiny
model and tokenizer are the test suite's (``tests/conftest.py``), so the check exercises what the tests do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the checkout's packages and tests first
    sys.path.insert(0, str(ROOT))

# prompts of the greedy-exactness step (ids of the tiny tokenizer, BOS first) and their token budget
EXACT_PROMPTS = ([1, 5, 9, 33, 20], [1, 70], [1, 44, 12, 90, 3, 3, 61, 8, 17])
EXACT_NEW_TOKENS = 40


def write_json(path: Path, data: dict) -> None:
    from medusa_train.files.atomic import atomic_write_text

    atomic_write_text(Path(path), json.dumps(data, indent=1) + "\n")


def inputs(folder: Path, conversations: int = 40) -> None:
    """``folder/tiny_llama`` (the suite's 2-layer Llama, hidden 32, with its 97-id character tokenizer and ChatML
    template) and ``folder/conversations.jsonl`` (the suite's "count from W" conversations, predictable for heads)."""
    from tests.conftest import make_tiny_model, make_tiny_tokenizer
    from tests.medusa_train.test_training import counting_conversations, write_jsonl

    model_dir = folder / "tiny_llama"
    make_tiny_model("llama", seed=0).save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    write_jsonl(folder / "conversations.jsonl", counting_conversations(conversations))
    print(f"inputs: {model_dir} and {folder / 'conversations.jsonl'} ({conversations} conversations)")


def exact(device: str, dtypes: list[str], out: Path) -> bool:
    """Greedy tree decoding against plain greedy decoding, for every drafter type of the catalog with random heads
    (they disagree with the base often, so most drafts are rejected: the acceptance rule is exercised), on the tiny
    Llama in each dtype on ``device``. fp32 must match token for token; in bf16 the tree pass and the one-token pass
    reduce in different orders, so a near-tie can flip an argmax: the share of identical replies is reported."""
    import torch

    from inference.decoders import DecodeConfig, TreeDecoder, VanillaDecoder
    from medusa_train.tree.buffers import SMALL_TREE_15
    from medusa_train.models.catalog import head_types
    from medusa_train.config.precision import parse_dtype
    from tests.conftest import make_tiny_model
    from tests.inference.test_decoders import random_heads

    rows, ok = [], True
    for dtype_name in dtypes:
        dtype = parse_dtype(dtype_name)
        for head_type in head_types():
            model = random_heads(head_type, make_tiny_model("llama")).to(device=device, dtype=dtype)
            tree = TreeDecoder(model, [list(p) for p in SMALL_TREE_15], topk=10)
            plain = VanillaDecoder(model.base)
            same, accepted = 0, []
            for prompt in EXACT_PROMPTS:
                config = DecodeConfig(max_new_tokens=EXACT_NEW_TOKENS)
                result = tree.generate(prompt, config)
                same += result.tokens == plain.generate(prompt, config).tokens
                accepted.append(result.mean_accepted_tokens)
            share = same / len(EXACT_PROMPTS)
            rows.append({"drafter": head_type, "dtype": str(dtype).removeprefix("torch."), "device": device,
                         "identical_replies": share, "mean_accepted_tokens": statistics.fmean(accepted)})
            ok &= share == 1.0 or dtype != torch.float32
            print(f"exact: {head_type} {dtype} on {device}: {same}/{len(EXACT_PROMPTS)} replies identical")
    write_json(out, {"rows": rows})
    return ok


def speed(config_path: Path, device: str, dtype_name: str, num_layers: int | None, new_tokens: int, prompts: int,
          out: Path) -> None:
    """Tokens/s of plain and tree decoding (Medusa heads, the 15-node tree) on a model built from ``config_path``
    with random weights, interleaved per prompt after one warm-up of each. Random weights and heads mean τ near 1:
    this row measures what a decoding pass costs on the hardware (a tree pass against a one-token pass), not the
    speedup trained heads give."""
    import torch
    import transformers

    from inference.decoders import DecodeConfig, TreeDecoder, VanillaDecoder
    from medusa_train.tree.buffers import SMALL_TREE_15
    from medusa_train.models.speculative import SpeculativeModel, new_heads_for
    from medusa_train.config.precision import parse_dtype

    dtype = parse_dtype(dtype_name)
    config = transformers.AutoConfig.from_pretrained(config_path)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model = SpeculativeModel(base, new_heads_for(base, 3, dtype=dtype).to(device))
    decoders = {"vanilla": VanillaDecoder(base), "medusa": TreeDecoder(model, [list(p) for p in SMALL_TREE_15])}
    generator = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(3, config.vocab_size, (64,), generator=generator).tolist() for _ in range(prompts + 1)]
    times = {name: [] for name in decoders}
    tokens = {name: 0 for name in decoders}
    accepted = []
    for i, prompt in enumerate(prompt_ids):  # the first prompt warms each decoder up and is not counted
        for name, decoder in decoders.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = decoder.generate(prompt, DecodeConfig(max_new_tokens=new_tokens))
            elapsed = time.perf_counter() - start
            if i:
                times[name].append(elapsed)
                tokens[name] += len(result.tokens)
                if name == "medusa":
                    accepted.append(result.mean_accepted_tokens)
    rows = {name: {"tokens_per_second": tokens[name] / sum(times[name]),
                   "seconds_per_prompt_median": statistics.median(times[name])} for name in decoders}
    rows["medusa"]["mean_accepted_tokens"] = statistics.fmean(accepted)
    rows["medusa"]["speedup"] = rows["medusa"]["tokens_per_second"] / rows["vanilla"]["tokens_per_second"]
    params = sum(p.numel() for p in base.parameters())
    write_json(out, {"config": str(config_path), "layers": config.num_hidden_layers, "params": params,
                     "dtype": str(dtype).removeprefix("torch."), "device": device, "new_tokens": new_tokens,
                     "prompts": prompts, "decoders": rows})
    print(f"speed: {params / 1e9:.2f}B params, {json.dumps(rows)}")


# the memory step's model: big enough on a GPU that its terms dominate the allocator's slack (a 32k vocabulary, so the
# loss's logits and the heads' projections count), tiny on the CPU of a dry run
MEMORY_MODEL = {"cuda": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=8),
                "cpu": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)}


def memory(device: str, inputs_dir: Path, out: Path) -> bool:
    """One short ``medusa-train`` run (Medusa-1, 3 heads, the base live: no hidden cache) on a model built from
    :data:`MEMORY_MODEL`, then the memory plan's peak per device against ``torch.cuda.max_memory_allocated``, both
    read from the export's training record (``training.memory``). Fails when the measured peak exceeds the plan
    (the plan is meant to bound it). On a CPU nothing is measured: the step checks that the plan was recorded."""
    import subprocess

    import torch
    import transformers

    from tests.conftest import make_tiny_tokenizer

    kind = "cuda" if device.startswith("cuda") else "cpu"
    model_dir, run = out.parent / "memory_model", out.parent / "memory_run"
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **MEMORY_MODEL[kind])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    overrides = [f"model.name_or_path={model_dir}", "model.format=hf", "model.tokenizer_path=null",
                 f"model.dtype={'bfloat16' if kind == 'cuda' else 'float32'}", "data=json",
                 f"data.path={inputs_dir / 'conversations.jsonl'}", "data.eval_fraction=0.1", "heads.num_heads=3",
                 "heads.target=labels", "trainer=ddp", "trainer.max_steps=2", "trainer.per_device_train_batch_size=8",
                 "trainer.save_steps=100", "trainer.disable_tqdm=true", "export_vllm=false",
                 f"max_length={256 if kind == 'cuda' else 64}", f"output_dir={run}", f"hydra.run.dir={run}/hydra"]
    if kind == "cuda":
        overrides += ["trainer.precision=bf16"]
    else:
        overrides += ["trainer.use_cpu=true", "trainer.ddp_backend=gloo", "trainer.precision=fp32"]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
                    "medusa_train.cli.train", *overrides], check=True, cwd=ROOT)
    record = json.loads((run / "export" / "config.json").read_text())["training"]["memory"]
    planned, measured = record["planned_peak_device_bytes"], record["measured_peak_device_bytes"]
    gib = 2 ** 30
    row = {"stage": f"medusa-1 run, base live ({config.num_hidden_layers} layers, "
                    f"vocab {config.vocab_size}, hidden {config.hidden_size})",
           "planned_gib": planned / gib if planned is not None else None,
           "measured_gib": measured / gib if measured is not None else None,
           "ratio": measured / planned if planned and measured is not None else None}
    write_json(out, {"device": device, "rows": [row]})
    print(f"memory: {row}")
    if planned is None:
        return False
    return measured is None or measured <= planned


def _fmt(value: object, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(out: Path) -> str:
    """The check's one table: a row per step (status, seconds, log), then the greedy-exactness rows, the speed rows
    and the memory plan's row, from whichever of ``exact.json``, ``speed.json``, ``memory.json`` exist."""
    lines = ["| step | status | seconds | log |", "| --- | --- | ---: | --- |"]
    steps = out / "steps.tsv"
    for row in (steps.read_text().splitlines() if steps.is_file() else []):
        name, status, seconds, log = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"| {name} | {status} | {seconds} | {log} |")
    if (out / "exact.json").is_file():
        lines += ["", "| greedy exactness: drafter | dtype | device | identical replies | τ (random heads) |",
                  "| --- | --- | --- | ---: | ---: |"]
        for r in json.loads((out / "exact.json").read_text())["rows"]:
            lines.append(f"| {r['drafter']} | {r['dtype']} | {r['device']} | {r['identical_replies']:.2f} | "
                         f"{r['mean_accepted_tokens']:.2f} |")
    if (out / "speed.json").is_file():
        s = json.loads((out / "speed.json").read_text())
        lines += ["", f"| speed: {s['params'] / 1e9:.2f}B params ({s['layers']} layers), {s['dtype']} on {s['device']}, "
                      f"{s['prompts']} prompts x {s['new_tokens']} tokens | tokens/s | median s/prompt | τ | speedup |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, m in s["decoders"].items():
            lines.append(f"| {name} | {m['tokens_per_second']:.1f} | {m['seconds_per_prompt_median']:.3f} | "
                         f"{_fmt(m.get('mean_accepted_tokens'), '.2f')} | {_fmt(m.get('speedup'), '.2f')} |")
    if (out / "memory.json").is_file():
        m = json.loads((out / "memory.json").read_text())
        lines += ["", "| memory: stage | planned GiB | measured GiB | measured / planned |", "| --- | ---: | ---: | ---: |"]
        for r in m["rows"]:
            lines.append(f"| {r['stage']} | {_fmt(r['planned_gib'], '.3f')} | {_fmt(r.get('measured_gib'), '.3f')} | "
                         f"{_fmt(r.get('ratio'), '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inputs", help="write the tiny model, tokenizer and conversations").add_argument("folder")
    p = sub.add_parser("exact", help="tree decoding's greedy output against plain greedy decoding")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", required=True)
    p = sub.add_parser("speed", help="plain vs tree decoding tokens/s on a model built from a config")
    p.add_argument("--config", required=True, help="a config.json (random weights are built from it)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers (a smaller model)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--out", required=True)
    p = sub.add_parser("memory", help="the memory plan against the measured peak of one short run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--inputs", required=True, help="the folder `inputs` wrote (its conversations are used)")
    p.add_argument("--out", required=True)
    sub.add_parser("report", help="print the table of a check's folder").add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "inputs":
        inputs(Path(args.folder))
    elif args.command == "exact":
        return 0 if exact(args.device, args.dtypes.split(","), Path(args.out)) else 1
    elif args.command == "memory":
        return 0 if memory(args.device, Path(args.inputs), Path(args.out)) else 1
    elif args.command == "speed":
        speed(Path(args.config), args.device, args.dtype, args.num_layers, args.new_tokens, args.prompts,
              Path(args.out))
    else:
        print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
