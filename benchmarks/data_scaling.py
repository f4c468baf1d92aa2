"""The data-scaling table: Medusa, Hydra and EAGLE-3 trained on 1x, 4x and 16x regenerated data, side by side.

    nohup python benchmarks/data_scaling.py --cells medusa:1 hydra:1 eagle3:1 medusa:4 --commit > runs/scale/log &
    python benchmarks/data_scaling.py --render       # docs/data-scaling.md and the plot again, from the JSON

A cell is ``DRAFTER:SIZE`` (``medusa``, ``hydra`` or ``eagle3``; SIZE a multiple of the quickstart's 700 ShareGPT
conversations, 1 to 22: :data:`MAX_SIZE`), optionally ``:vocab=N`` (the head / draft vocabulary) and ``:ttt=K``
(EAGLE-3's training-time-test steps). For each cell, in order:

1. ``bash launch/recipe_scale.sh DRAFTER SIZE``: regenerated replies (shared by the drafters of a size), training,
   export and the tree tuned on this CPU (every step resumes after a kill, a finished one is not redone). The replies
   of a size are kept in the repository, ``data/scale/replies-SIZE.tar.gz``, written (and with ``--commit``
   committed) once the first cell of that size has trained, and unpacked into ``OUT/replies-SIZE/`` before any later
   cell of the size: the three drafters of a size train on the same replies even when their cells run in different
   sessions, on other machines, and a 16x cell does not spend an hour regenerating them again;
2. three ``medusa-eval`` runs on the export (each resumes): MT-Bench first turns (``--per-category`` of each of its 8
   categories, in the dtype the tree was tuned in) with our tree decoder beside plain decoding, and vLLM plain and
   with the drafter where vLLM serves it (Medusa, EAGLE-3; its mean acceptance length); the Spec-Bench set the same
   way with ours; the fp32 exactness check (MT-Bench, one prompt a category, greedy, fp32). With llama.cpp installed
   (``bash launch/install_llamacpp.sh``), an EAGLE-3 cell's MT-Bench run also has ``llamacpp`` and
   ``llamacpp_eagle3`` (``python benchmarks/llamacpp_table.py RUN/eval-mt_bench`` gives their table);
3. the cell's record appended to ``docs/data-scaling.json`` (atomic), ``docs/data-scaling.md`` and
   ``docs/figures/data-scaling.png`` rewritten; with ``--commit`` those files committed (nothing else).

A cell already in the JSON is never run again (delete its object to redo it). Timed steps run alone only if nothing
else runs on the machine: each record keeps the load average before and after, and the CPU's flags and model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import gzip
import io
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.evaluation.eval_config import EvaluateConfig  # noqa: E402
from medusa_train.files.atomic import atomic_write, atomic_write_text  # noqa: E402
from medusa_train.config.bounds import Bound  # noqa: E402
from medusa_train.models.catalog import drafter_type  # noqa: E402
from medusa_train.files.checksums import file_sha256  # noqa: E402
from medusa_train.cli.flags import FlagParser, check_flags, schema_bound  # noqa: E402
from medusa_train.config.schema import HeadsConfig  # noqa: E402
from medusa_train.engines.llamacpp_env import llamacpp_available  # noqa: E402
from medusa_train.engines.vllm_env import vllm_available  # noqa: E402
from medusa_train.config.precision import cpu_flags  # noqa: E402
from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET  # noqa: E402

DRAFTERS = ("medusa", "hydra", "eagle3")  # the drafters launch/recipe_scale.sh trains
QUICKSTART_CONVERSATIONS = 700
# The largest SIZE: SIZE x 700 ShareGPT conversations stay below the held-out prompts the tuner and the evaluation
# read (they start at conversation SHAREGPT_HELDOUT_OFFSET, 16,000), so no cell trains on what it is measured on.
# 22 (15,400 conversations); launch/recipe_scale.sh refuses above it too (tests/test_data_scaling.py checks both).
MAX_SIZE = SHAREGPT_HELDOUT_OFFSET // QUICKSTART_CONVERSATIONS
# each number of a cell, and the config field's bound it is checked with (a cell's settings become those fields)
CELL_BOUNDS = {"size": Bound(1, MAX_SIZE, hint=f"SIZE x {QUICKSTART_CONVERSATIONS} ShareGPT conversations stay "
                             f"below the held-out prompts at {SHAREGPT_HELDOUT_OFFSET:,}"),
               "vocab": schema_bound(HeadsConfig, "head_vocab_size"),
               "ttt": schema_bound(HeadsConfig, "num_heads")}
TABLE = ROOT / "docs" / "data-scaling.json"
DOC = ROOT / "docs" / "data-scaling.md"
PLOT = ROOT / "docs" / "figures" / "data-scaling.png"
REPLIES = ROOT / "data" / "scale"  # replies-SIZE.tar.gz: the regenerated replies of each size, committed


def parse_cell(text: str) -> dict[str, Any]:
    """``DRAFTER:SIZE[:vocab=N][:ttt=K]`` -> ``{"drafter", "size", "vocab", "ttt"}`` (None: the recipe's default).

    Raises:
        ValueError: an unknown drafter, a size or setting that is not a decimal integer in ASCII digits or is out of
            its range (:data:`CELL_BOUNDS`: SIZE at most :data:`MAX_SIZE`), ttt for another drafter; the cell named.
    """
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in DRAFTERS:
        raise ValueError(f"--cells {text!r}: write DRAFTER:SIZE with DRAFTER one of {', '.join(DRAFTERS)}")
    cell: dict[str, Any] = {"drafter": parts[0], "size": _number(parts[1], text, "size"), "vocab": None, "ttt": None}
    for option in parts[2:]:
        key, _, value = option.partition("=")
        if key not in ("vocab", "ttt"):
            raise ValueError(f"--cells {text!r}: unknown setting {key!r} (vocab=N, ttt=K)")
        cell[key] = _number(value, text, key)
    if cell["ttt"] is not None and not drafter_type(cell["drafter"]).sequence:
        raise ValueError(f"--cells {text!r}: ttt= is EAGLE-3's training-time-test steps (eagle3 cells only)")
    return cell


def vllm_decoder(drafter: str) -> str | None:
    """The decoder that serves ``drafter``'s export in vLLM, ``vllm_<method>`` of the type's vLLM method (None: vLLM
    serves no such drafter, Hydra heads)."""
    method = drafter_type(drafter).vllm_method
    return None if method is None else f"vllm_{method}"


def _number(value: str, text: str, key: str) -> int:
    """``value``, the ``key`` of cell ``text``, as an int within :data:`CELL_BOUNDS`.

    Raises:
        ValueError: not ASCII digits (``str.isdigit`` admits ``²``, which ``int`` refuses), 0 or out of range.
    """
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ValueError(f"--cells {text!r}: {value!r} is not a positive integer")
    try:
        CELL_BOUNDS[key].check(int(value), key)
    except ValueError as e:
        raise ValueError(f"--cells {text!r}: {e}") from None
    return int(value)


def cell_name(cell: dict[str, Any]) -> str:
    """The cell's key and run folder name: ``eagle3-4``, ``eagle3-4-vocab16384-ttt7``."""
    tag = "".join(f"-{key}{cell[key]}" for key in ("vocab", "ttt") if cell.get(key) is not None)
    return f"{cell['drafter']}-{cell['size']}{tag}"


def run(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``command`` from the checkout, its output appended to ``log``.

    Raises:
        RuntimeError: it failed (naming the log).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}  # {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
        out.flush()
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed (exit {done.returncode}): see {log}")


def replies_archive(size: int) -> Path:
    """The committed archive of the replies regenerated for ``size``: ``data/scale/replies-SIZE.tar.gz``."""
    return REPLIES / f"replies-{size}.tar.gz"


def archive_replies(folder: Path, archive: Path) -> bool:
    """Pack the reply blocks in ``folder`` into ``archive`` (atomic; the same bytes for the same files: names sorted,
    times, owners and the gzip header's time zeroed), unless it exists. Call it only once the replies are complete
    (a cell of their size has trained).

    Returns:
        True when the archive was written, False when it existed already.

    Raises:
        FileNotFoundError: ``folder`` holds no reply block (``*.jsonl``).
    """
    if archive.is_file():
        return False
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{folder}: no reply blocks (*.jsonl) to archive: did the cell's training run?")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    archive.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(archive, lambda p: p.write_bytes(gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)))
    return True


def restore_replies(archive: Path, folder: Path) -> int:
    """Unpack the committed replies ``archive`` into ``folder`` (made if missing), each block written atomically over
    a shorter or different one (the archive is complete, a block left by a killed regeneration is not); blocks already
    equal are left alone. Nothing happens without the archive.

    Returns:
        The number of block files written.

    Raises:
        ValueError: a member that is not a plain ``*.jsonl`` file name (the archive is not one of ours).
    """
    if not archive.is_file():
        return 0
    written = 0
    with tarfile.open(archive, mode="r:gz") as tar:
        members = tar.getmembers()
        for member in members:  # all checked before any is written
            if not member.isfile() or "/" in member.name or not member.name.endswith(".jsonl"):
                raise ValueError(f"{archive}: member {member.name!r} is not a reply block: delete the archive and "
                                 "let the next cell of its size regenerate the replies")
        for member in members:
            data = tar.extractfile(member).read()
            target = folder / member.name
            if target.is_file() and target.read_bytes() == data:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(target, lambda p, data=data: p.write_bytes(data))
            written += 1
    return written


def evaluate(export: Path, out: Path, log: Path, decoders: list[str], settings: list[str]) -> dict[str, Any]:
    """One ``medusa-eval`` run (resumed when ``out`` holds a part of it) -> its ``summary.json``."""
    medusa_eval = str(Path(sys.executable).with_name("medusa-eval"))
    run([medusa_eval, f"export_dir={export}", f"output_dir={out}", "max_turns=1", f"decoders=[{','.join(decoders)}]",
         *settings], log)
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def ours(summary: dict[str, Any]) -> dict[str, Any]:
    """Our tree decoder's figures in a ``summary.json``: τ, speedup over plain decoding and its 95% interval."""
    m = summary["decoders"]["medusa"]
    interval = m.get("speedup_interval") or {}
    return {"tau": m["mean_accepted_tokens"], "speedup": m["speedup"], "speedup_low": interval.get("low"),
            "speedup_high": interval.get("high"), "prompts": summary["prompts"],
            "exact_match_vs_vanilla": m["exact_match_vs_greedy"], "dtype": summary["dtype"]}


def measure(cell: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Train (``launch/recipe_scale.sh``) and evaluate one cell -> its record."""
    name = cell_name(cell)
    folder = Path(args.out) / name
    log = Path(args.out) / f"{name}.log"
    env = {"SCALE_OUT": args.out}
    if cell["vocab"] is not None:
        env["SCALE_HEAD_VOCAB"] = str(cell["vocab"])
    if cell["ttt"] is not None:
        env["SCALE_TTT_STEPS"] = str(cell["ttt"])
    if name != f"{cell['drafter']}-{cell['size']}":
        env["SCALE_TAG"] = name.split("-", 2)[2]
    replies, archive = Path(args.out) / f"replies-{cell['size']}", replies_archive(cell["size"])
    restored = restore_replies(archive, replies)
    if restored:
        print(f"{name}: {restored} reply blocks unpacked from {archive.relative_to(ROOT)} into {replies}", flush=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    run(["bash", "launch/recipe_scale.sh", cell["drafter"], str(cell["size"])], log, env)
    if archive_replies(replies, archive) and args.commit:  # before the evaluations: kept if the session ends in them
        commit([archive], f"data-scaling: the regenerated replies of size {cell['size']} ({archive.name})")
    export = folder / "export"
    config = json.loads((export / "config.json").read_text(encoding="utf-8"))
    training = config.get("training") or {}
    common = ["max_new_tokens=64", "dtype=auto"]
    mt_decoders = ["vanilla", "medusa"]
    engine = vllm_decoder(cell["drafter"])
    if vllm_available() and engine is not None:
        mt_decoders += ["vllm", engine]
    if drafter_type(cell["drafter"]).llamacpp_gguf is not None and llamacpp_available():
        mt_decoders += ["llamacpp", "llamacpp_eagle3"]  # llama.cpp with the drafter: benchmarks/llamacpp_table.py
    mt = evaluate(export, folder / "eval-mt_bench", log, mt_decoders,
                  ["prompts=mt_bench", f"per_category={args.per_category}", *common])
    spec = evaluate(export, folder / "eval-spec_bench", log, ["vanilla", "medusa"],
                    ["prompts=spec_bench", f"per_category={args.per_category}", *common])
    exact = evaluate(export, folder / "eval-fp32", log, ["vanilla", "medusa"],
                     ["prompts=mt_bench", "per_category=1", "max_new_tokens=32", "dtype=float32"])
    vllm_tau = mt["decoders"].get(engine, {}).get("mean_accepted_tokens") if engine else None
    llamacpp = mt["decoders"].get("llamacpp_eagle3")
    data = training.get("data") or {}
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    return {
        "cell": name, **cell, "conversations_read": QUICKSTART_CONVERSATIONS * cell["size"],
        "replies": {"archive": str(archive.relative_to(ROOT)), "sha256": file_sha256(archive)[:16],
                    "restored_blocks": restored},
        "labelled_tokens": data.get("labelled_tokens"), "train_conversations": data.get("train_conversations"),
        "epochs": training.get("num_train_epochs"), "precision": _precision(training.get("precision")),
        "head_vocab_size": config.get("head_vocab_size"), "steps": config.get("medusa_num_heads")
        or config.get("eagle3_num_steps") or config.get("hydra_num_heads"),
        "train_minutes": None if training.get("train_runtime_s") is None else training["train_runtime_s"] / 60,
        "resumed": training.get("resumed_from") is not None,
        "cell_minutes": (time.perf_counter() - started) / 60,
        "mt_bench": ours(mt), "spec_bench": ours(spec),
        "vllm_mean_acceptance_length": vllm_tau,
        "vllm": None if engine else "vLLM serves no Hydra heads",
        "llamacpp_eagle3": None if llamacpp is None else {
            "mean_accepted_tokens": llamacpp["mean_accepted_tokens"], "speedup_over_vanilla": llamacpp["speedup"],
            "speedup_over_llamacpp": _ratio(llamacpp, mt["decoders"].get("llamacpp"))},
        "exact_match_fp32": exact["decoders"]["medusa"]["exact_match_vs_greedy"],
        "cpu": {"model": cpu_model(), "flags": flags, "cores": os.cpu_count()},
        "load_average": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "train_load_average": training.get("load_average"),
        "commit": git("rev-parse", "--short", "HEAD"), "date": datetime.now(timezone.utc).date().isoformat(),
    }


def _ratio(mine: dict[str, Any], plain: dict[str, Any] | None) -> Any:
    if not plain or not plain.get("tokens_per_second") or mine.get("tokens_per_second") is None:
        return None
    return mine["tokens_per_second"] / plain["tokens_per_second"]


def _precision(record: Any) -> Any:
    """The mixed precision trained in: the record's ``precision`` (``auto`` resolved), or an older export's string."""
    return record.get("precision") if isinstance(record, dict) else record


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git(*args: str) -> str:
    """``git ARGS`` in the checkout, its stdout stripped."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def read_table() -> list[dict[str, Any]]:
    return json.loads(TABLE.read_text(encoding="utf-8")) if TABLE.is_file() else []


def _f(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(cells: list[dict[str, Any]]) -> str:
    """The table of ``docs/data-scaling.md`` (between its markers): one row per cell, sorted by drafter and size."""
    lines = ["| cell | labelled tokens | epochs | precision | train min | MT-Bench τ | speedup [95%] | "
             "Spec-Bench τ | speedup [95%] | vLLM acceptance length | exact fp32 | CPU (load) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in sorted(cells, key=lambda c: (DRAFTERS.index(c["drafter"]), c["size"], c["cell"])):
        def bench(b: dict[str, Any]) -> str:
            return (f"{_f(b['tau'])} | {_f(b['speedup'])}x [{_f(b['speedup_low'])}, {_f(b['speedup_high'])}] "
                    f"({b['prompts']})")
        cpu = "AMX" if "amx_bf16" in c["cpu"]["flags"] else "AVX-512 BF16" if "avx512_bf16" in c["cpu"]["flags"] \
            else "AVX2"
        lines.append(f"| {c['cell']} | {_f(c['labelled_tokens'], ',')} | {_f(c['epochs'], '')} | "
                     f"{c['precision'] or 'n/a'} | {_f(c['train_minutes'], '.1f')} | {bench(c['mt_bench'])} | "
                     f"{bench(c['spec_bench'])} | {_f(c['vllm_mean_acceptance_length'])} | "
                     f"{_f(c['exact_match_fp32'])} | {cpu} ({c['load_average']['before']}/"
                     f"{c['load_average']['after']}) |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- table: benchmarks/data_scaling.py --render -->", "<!-- end of table -->"


def render(cells: list[dict[str, Any]]) -> None:
    """Rewrite the table in ``docs/data-scaling.md`` (the text around the markers is kept) and the plot."""
    text = DOC.read_text(encoding="utf-8") if DOC.is_file() else f"# Which drafter at which data size\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC}: the table markers {BEGIN!r} and {END!r} are missing: put them back where the "
                         "table goes")
    head, rest = text.split(BEGIN, 1)
    atomic_write_text(DOC, f"{head}{BEGIN}\n{markdown(cells)}{END}{rest.split(END, 1)[1]}")
    plot(cells)


def plot(cells: list[dict[str, Any]]) -> None:
    """τ on MT-Bench against labelled tokens, one line per drafter (default settings only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in DRAFTERS:
        mine = sorted((c for c in cells if c["drafter"] == drafter and c["vocab"] is None and c["ttt"] is None
                       and c["labelled_tokens"]), key=lambda c: c["labelled_tokens"])
        if mine:
            ax.plot([c["labelled_tokens"] for c in mine], [c["mt_bench"]["tau"] for c in mine], marker="o",
                    label=drafter)
    ax.set_xscale("log")
    ax.set_xlabel("labelled tokens (self-distilled replies)")
    ax.set_ylabel("τ, MT-Bench, our tree decoder")
    ax.set_title("mean accepted tokens against training data")
    ax.grid(True, alpha=0.3)
    ax.legend()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT.with_suffix(".tmp.png"), dpi=120)
    plt.close(fig)
    os.replace(PLOT.with_suffix(".tmp.png"), PLOT)


BOUNDS = {"per_category": schema_bound(EvaluateConfig, "per_category")}  # each numeric flag's range


def build_parser() -> FlagParser:
    """The flags; a bad one is refused in one line naming it, exit status 2 (:class:`FlagParser`)."""
    parser = FlagParser(prog="data_scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="*", default=[],
                        help=f"DRAFTER:SIZE[:vocab=N][:ttt=K], run in order (SIZE 1 to {MAX_SIZE})")
    parser.add_argument("--out", default="runs/scale", help="the runs' folder (SCALE_OUT)")
    parser.add_argument("--per-category", type=int, default=2, help="prompts of each category, MT-Bench and Spec-Bench")
    parser.add_argument("--commit", action="store_true", help="commit the table's files after each cell")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown table and the plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_flags(parser, args, BOUNDS)
    try:
        cells = [parse_cell(c) for c in args.cells]
    except ValueError as e:
        parser.error(str(e))
    if args.render:
        render(read_table())
        return 0
    for cell in cells:
        name = cell_name(cell)
        if any(c["cell"] == name for c in read_table()):
            print(f"{name}: in {TABLE} already, not run again", flush=True)
            continue
        print(f"{name}: running (log: {Path(args.out) / (name + '.log')})", flush=True)
        record = measure(cell, args)
        table = [c for c in read_table() if c["cell"] != name] + [record]
        atomic_write_text(TABLE, json.dumps(table, indent=1, ensure_ascii=False) + "\n")
        render(table)
        print(f"{name}: done, {json.dumps(record['mt_bench'])}", flush=True)
        if args.commit:
            commit([TABLE, DOC, PLOT], f"data-scaling: cell {name}")
    return 0


def commit(paths: list[Path], message: str, tries: int = 10) -> None:
    """Commit ``paths`` alone (whatever else is staged stays out), retried while another git command holds the
    index lock.

    Raises:
        RuntimeError: git refused every try (its message given).
    """
    files = [str(p.relative_to(ROOT)) for p in paths]
    for _ in range(tries):
        added = subprocess.run(["git", "add", "--", *files], cwd=ROOT, capture_output=True, text=True)
        done = added if added.returncode else subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", *files], cwd=ROOT, capture_output=True, text=True)
        if done.returncode == 0:
            return
        time.sleep(30)
    raise RuntimeError(f"git would not commit {files}: {done.stderr.strip()}")


if __name__ == "__main__":
    sys.exit(main())
