"""One cell of the data-scaling table (``docs/data-scaling.md``): ``bash launch/recipe_scale.sh DRAFTER SIZE``.

- ``DRAFTER``: ``medusa`` (Medusa-1 heads), ``hydra`` (Hydra heads) or ``eagle3`` (an EAGLE-3 drafter);
- ``SIZE``: 1 to :data:`MAX_SIZE`, the multiple of the quickstart's data (``SIZE`` x 700 ShareGPT conversations read,
  their first turns of at most 128 tokens answered again by the target itself through vLLM's engine).

The quickstart's recipe (``launch/recipe_settings.py``, shared) trains into ``$SCALE_OUT/DRAFTER-SIZE/`` (default
``runs/scale``), and ``medusa-tune-tree`` tunes the tree of its export on this CPU. The regenerated replies of a size,
``$SCALE_OUT/replies-SIZE/``, are written by the first drafter trained at that size and read by the others. Two
stages, each resumed after a kill and not redone once finished:

1. ``train``: ``medusa-train`` (``resume=true`` when the run's folder holds what a killed run left; sealed reply
   blocks). ``trained.stamp`` records its overrides once it finished: a later run with other settings in the same
   folder is refused, naming them (give the cell a ``SCALE_TAG`` of its own, or remove the folder);
2. ``tune``: ``medusa-tune-tree`` on the export; ``tuned.stamp`` once it finished (a retrained export, newer than
   the stamp, is tuned again).

Medusa-1 and Hydra of a size read the same features of the same replies: their hidden-state cache is one,
``$SCALE_OUT/hidden-SIZE[-TAG]/`` (built by the first of them trained, 34 min for the 1.5B at size 1 on 2 cores), and
EAGLE-3's, which holds three more of the target's layers, stays in its run folder. Where a cache lives is not compared
with a finished run's settings (a cache moved there from ``DRAFTER-SIZE/hidden_cache`` is reused: its seals name no
path). The seals fingerprint the data and the target's weights and dtype, so a Medusa-1 and a Hydra cell of one size
with other data or target settings would rebuild each other's cache: give such cells a ``SCALE_TAG``.

Run one cell at a time per ``SCALE_OUT`` (the replies and the shared cache are shared). ``benchmarks/data_scaling.py``
and ``benchmarks/coder_table.py`` run the cells and evaluate them. Knobs (environment variables): ``SCALE_OUT``
(``runs/scale``), ``SCALE_EPOCHS`` (5 at SIZE < 4, 3 at SIZE < 16, 2 from 16: the field trains 2-3 epochs on 500k
samples), ``SCALE_HEAD_VOCAB`` (4096: the head / draft vocabulary), ``SCALE_TTT_STEPS`` (EAGLE-3's training-time-test
steps; empty: the preset's), ``SCALE_PRECISION`` (``trainer.precision``; auto: bf16 where the CPU has bf16
instructions), ``SCALE_DTYPE`` (auto: the dtype the tree is tuned in), ``SCALE_DISTILL_ENGINE`` (vllm; hf generates with
the fp32 training model, much slower), ``SCALE_TAG`` (appended to the run folder's name: a cell with other settings),
``MEDUSA_VLLM_VENV`` (.venv-vllm), ``MEDUSA_VENV`` (.venv); for another target (``benchmarks/coder_table.py``:
Qwen2.5-Coder-1.5B), ``SCALE_MODEL`` (its ``model/`` preset; smollm2_135m), ``SCALE_MODEL_DTYPE`` (the frozen target's
dtype in training and in the hidden-state cache; float32), ``SCALE_CODE_SHARE`` (``data.code_share``: the share of code
conversations; empty: file order) and ``SCALE_EXCLUDE`` (``data.exclude_prompts``, e.g. humaneval: its problems never
trained on). Give each target its own ``SCALE_OUT``: the replies of a size are the target's.

Every argument and knob is checked before anything runs (exit status 2, one line naming it). Standard library only:
it runs before the project's environment exists (it runs ``launch/install.sh`` first).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from argparse import ArgumentTypeError
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_settings import (ROOT, RecipeKnobs, engine_line, overrides, positive, resumes, vllm_ready,  # noqa: E402
                             vllm_venv)

USAGE = "usage: bash launch/recipe_scale.sh DRAFTER SIZE (DRAFTER: medusa, hydra or eagle3; SIZE: 1, 4, 16, ...)"
DRAFTER_HEADS = {"medusa": [], "hydra": ["heads=hydra"], "eagle3": ["heads=eagle3"]}
# the drafters that read the same target features (the last hidden state only: the catalog's ``features`` of
# medusa_train.models.catalog, which tests/test_recipe_scale.py checks), so one hidden-state cache of a size serves
# them all; EAGLE-3 reads three more layers and keeps its own in its run folder
SHARED_CACHE = ("medusa", "hydra")
CACHE_DIR = "hidden_cache_dir="  # where a cache lives changes nothing it holds: not compared with a finished run's
CONVERSATIONS_PER_SIZE = 700  # the quickstart's
# SIZE x 700 ShareGPT conversations must stay below the held-out prompts the tuner and medusa-eval read (they start at
# conversation 16,000: SHAREGPT_HELDOUT_OFFSET in medusa_train/chat/prompts.py): 16000 / 700 = 22 (MAX_SIZE in
# benchmarks/data_scaling.py too; tests/test_data_scaling.py checks both)
MAX_SIZE = 22
TRAINED, TUNED = "trained.stamp", "tuned.stamp"


class RecipeError(ValueError):
    """A bad argument or knob, or a run folder trained with other settings: one line, exit status 2."""


@dataclass(frozen=True)
class Cell:
    """One cell's resolved settings: its run folder, replies folder and each command's overrides."""

    drafter: str
    size: int
    run: Path
    replies: Path
    knobs: RecipeKnobs
    train: list[str]
    tune: list[str]


def knob(env: Mapping[str, str], key: str, default: int | None) -> int | None:
    """The positive integer ``env[key]`` (:func:`recipe_settings.positive`), ``default`` when unset or empty."""
    text = env.get(key, "")
    if not text:
        return default
    try:
        return positive(text)
    except ArgumentTypeError as e:
        raise RecipeError(f"{key}={e}") from None


def cell(argv: Sequence[str], env: Mapping[str, str]) -> Cell:
    """The cell ``argv`` (``DRAFTER SIZE``) and the knobs of ``env`` name, checked.

    Raises:
        RecipeError: a bad argument or knob (named, with the usage or the values allowed).
    """
    if len(argv) != 2:
        raise RecipeError(USAGE)
    drafter, size_text = argv
    if drafter not in DRAFTER_HEADS:
        raise RecipeError(f"DRAFTER={drafter}: choose medusa, hydra or eagle3. {USAGE}")
    if not re.fullmatch(r"[1-9][0-9]*", size_text):
        raise RecipeError(f"SIZE={size_text}: give a positive integer (the multiple of the quickstart's "
                          f"{CONVERSATIONS_PER_SIZE} conversations). {USAGE}")
    size = int(size_text)
    if size > MAX_SIZE:
        raise RecipeError(f"SIZE={size}: give at most {MAX_SIZE} ({MAX_SIZE} x {CONVERSATIONS_PER_SIZE} = "
                          f"{MAX_SIZE * CONVERSATIONS_PER_SIZE} ShareGPT conversations; the held-out prompts start "
                          f"at 16,000). {USAGE}")
    epochs = knob(env, "SCALE_EPOCHS", 5 if size < 4 else 3 if size < 16 else 2)
    heads = list(DRAFTER_HEADS[drafter])
    ttt = knob(env, "SCALE_TTT_STEPS", None)
    if ttt is not None:
        if drafter != "eagle3":
            raise RecipeError(f"SCALE_TTT_STEPS={ttt}: only EAGLE-3 has training-time-test steps (DRAFTER=eagle3)")
        heads.append(f"heads.num_heads={ttt}")
    engine = env.get("SCALE_DISTILL_ENGINE") or "vllm"
    if engine not in ("vllm", "hf"):
        raise RecipeError(f"SCALE_DISTILL_ENGINE={engine}: choose vllm or hf")
    data_extra = []
    if env.get("SCALE_CODE_SHARE"):
        data_extra.append(f"data.code_share={env['SCALE_CODE_SHARE']}")
    if env.get("SCALE_EXCLUDE"):
        data_extra.append(f"data.exclude_prompts=[{env['SCALE_EXCLUDE']}]")
    knobs = RecipeKnobs(conversations=CONVERSATIONS_PER_SIZE * size, epochs=epochs,
                        head_vocab=knob(env, "SCALE_HEAD_VOCAB", RecipeKnobs.head_vocab),
                        dtype=env.get("SCALE_DTYPE") or "auto", precision=env.get("SCALE_PRECISION") or "auto",
                        distill_engine=engine, model_preset=env.get("SCALE_MODEL") or RecipeKnobs.model_preset,
                        model_dtype=env.get("SCALE_MODEL_DTYPE") or RecipeKnobs.model_dtype,
                        data_extra=tuple(data_extra))
    out = Path(env.get("SCALE_OUT") or "runs/scale")
    tag = env.get("SCALE_TAG") or ""
    suffix = f"-{tag}" if tag else ""
    run = out / f"{drafter}-{size}{suffix}"
    replies = out / f"replies-{size}"
    settings = overrides(knobs)
    train = [*settings["train"], *heads, f"data.self_distill_dir={replies}", f"output_dir={run}"]
    if drafter in SHARED_CACHE:
        train.append(f"{CACHE_DIR}{out / f'hidden-{size}{suffix}'}")
    tune = [f"export_dir={run / 'export'}", *settings["tune"],
            *(settings["tune_eagle3"] if drafter == "eagle3" else [])]
    return Cell(drafter, size, run, replies, knobs, train, tune)


def trained(c: Cell) -> bool:
    """The train stage finished with these settings (False: not finished).

    Raises:
        RecipeError: it finished with other settings (those that differ named), or its stamp is not one this recipe
            wrote.
    """
    stamp = c.run / TRAINED
    if not (stamp.is_file() and (c.run / "export" / "config.json").is_file()):
        return False
    text = stamp.read_text().strip()
    if not text:  # a stamp of the shell recipe, which recorded nothing: trusted as it was
        return True
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        record = None
    stamped = record.get("train", []) if isinstance(record, dict) else None
    if not isinstance(stamped, list) or not all(isinstance(a, str) for a in stamped):
        raise RecipeError(f"{stamp} is not a stamp this recipe wrote (a JSON object whose train is a list of "
                          f"overrides): remove it, or {c.run}, to train the cell again")
    recorded, now = ([a for a in args if not a.startswith(CACHE_DIR)] for args in (stamped, c.train))
    changed = [f"{a!r} then, {b!r} now" for a, b in zip(recorded, now) if a != b]
    if changed or len(recorded) != len(now):
        raise RecipeError(f"{c.run} was trained with other settings ({'; '.join(changed) or 'other overrides'}): "
                          f"give this cell a SCALE_TAG of its own, or remove {c.run} to train it again")
    return True


def tuned(c: Cell) -> bool:
    """The tune stage finished on the current export (a retrained export, newer than the stamp, is tuned again)."""
    stamp, config = c.run / TUNED, c.run / "export" / "config.json"
    return stamp.is_file() and config.is_file() and config.stat().st_mtime <= stamp.stat().st_mtime


def write_stamp(path: Path, record: dict | None = None) -> None:
    """``path`` written beside and renamed: a stamp is whole or absent."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record or {}) + "\n")
    os.replace(partial, path)


def commands(c: Cell) -> list[tuple[str, list[str] | None, dict | None]]:
    """``(stage, command or None when done, stamp record)`` for each stage, in order."""
    train = None if trained(c) else ["medusa-train", *c.train, f"resume={'true' if resumes(c.run) else 'false'}"]
    tune = None if tuned(c) and train is None else ["medusa-tune-tree", *c.tune]
    return [("train", train, {"train": c.train}), ("tune", tune, None)]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    os.chdir(ROOT)  # relative SCALE_OUT folders are the checkout's, as every command below sees them
    try:
        c = cell(list(sys.argv[1:] if argv is None else argv), env)
        if c.knobs.distill_engine == "vllm" and not vllm_ready():
            raise RecipeError(f"SCALE_DISTILL_ENGINE=vllm: vLLM's environment {vllm_venv()} is not installed: run "
                              "bash launch/install_vllm.sh (or SCALE_DISTILL_ENGINE=hf, much slower)")
        stages = commands(c)  # a folder trained with other settings is refused here, before anything runs
    except RecipeError as e:
        print(e, file=sys.stderr)
        return 2
    print(engine_line(c.knobs), flush=True)
    subprocess.run(["bash", str(ROOT / "launch" / "install.sh")], cwd=ROOT, check=True)
    venv = Path(env.get("MEDUSA_VENV") or ROOT / ".venv")
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", WANDB_MODE=env.get("WANDB_MODE", "offline"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    name = f"{c.drafter} x{c.size}"
    titles = {"train": f"medusa-train: {c.knobs.conversations} ShareGPT conversations read, replies in {c.replies}, "
                       f"{c.knobs.epochs} epochs -> {c.run / 'export'}",
              "tune": f"medusa-tune-tree: the tree for this CPU (dtype={c.knobs.dtype})"}
    for number, (stage, command, record) in enumerate(stages, start=1):
        if command is None:
            print(f"== {name} {number}/{len(stages)} {stage}: done ({c.run / 'export'})", flush=True)
            continue
        print(f"== {name} {number}/{len(stages)} {titles[stage]}", flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        write_stamp(c.run / (TRAINED if stage == "train" else TUNED), record)
    print(c.run / "export", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(f"recipe_scale: {' '.join(map(str, e.cmd[:1]))} failed with exit status {e.returncode}", file=sys.stderr)
        sys.exit(e.returncode)
