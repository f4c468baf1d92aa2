"""The settings the recipes share, defined once: the overrides of their ``medusa-train``, ``medusa-tune-tree`` and
``medusa-eval`` runs and the self-distillation engine. Read by ``launch/recipe_scale.py`` (imported) and by
``launch/quickstart.sh``, which evaluates the bash arrays this script prints::

    eval "$(python3 launch/recipe_settings.py --conversations 700 --epochs 5 ...)"   # train=(...) tune=(...) ...

Standard library only: it runs before the project's environment exists (``launch/install.sh`` makes it).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_STAMP = ".medusa-vllm-installed"  # written by launch/install_vllm.sh once `import vllm` worked
DISTILL_ENGINES = ("auto", "vllm", "hf")
RESUME_MARKERS = ("checkpoints", "export", "self_distill")  # what a killed medusa-train run leaves in its folder


def vllm_venv() -> Path:
    """vLLM's environment: ``MEDUSA_VLLM_VENV``, else ``.venv-vllm`` in the checkout."""
    return Path(os.environ.get("MEDUSA_VLLM_VENV") or ROOT / ".venv-vllm")


def resumes(run: Path) -> bool:
    """``run`` holds what a killed ``medusa-train`` run of it left (checkpoints, export, replies): pass
    ``resume=true``."""
    return any((run / name).is_dir() for name in RESUME_MARKERS)


def vllm_ready() -> bool:
    """vLLM's environment is installed (``bash launch/install_vllm.sh`` finished)."""
    return (vllm_venv() / VLLM_STAMP).is_file()


@dataclass(frozen=True)
class RecipeKnobs:
    """What a recipe chooses; everything else is fixed here.

    Attributes:
        conversations: ShareGPT conversations read (their first turns of at most 128 tokens are answered again).
        epochs: training epochs.
        head_vocab: the head / draft vocabulary (``heads.head_vocab_size``).
        dtype: the dtype the tree is tuned in and every decoder runs in (``auto``: bf16 where the CPU has bf16 units).
        tune_prompts: held-out prompts ``medusa-tune-tree`` measures head accuracy on.
        eval_tokens: ``max_new_tokens`` of ``medusa-eval``.
        precision: ``trainer.precision`` (``auto``: bf16 autocast where the CPU has bf16 instructions).
        distill_engine: ``auto`` (vLLM when its environment is installed, else HF), ``vllm`` or ``hf``.
        distill_dtype: vLLM's dtype for the replies (``auto``: bf16 where the hardware multiplies bf16 natively).
        model_preset: the target's ``model/`` preset.
        model_dtype: the frozen target's dtype in training and in the hidden-state cache.
        data_extra: further ``data.*`` overrides (``data.code_share=0.5``, ...).
    """

    conversations: int
    epochs: int
    head_vocab: int = 4096
    dtype: str = "auto"
    tune_prompts: int = 64
    eval_tokens: int = 64
    precision: str = "auto"
    distill_engine: str = "auto"
    distill_dtype: str = "auto"
    model_preset: str = "smollm2_135m"
    model_dtype: str = "float32"
    data_extra: tuple[str, ...] = field(default_factory=tuple)

    def engine(self) -> str:
        """The self-distillation engine this machine runs: ``auto`` resolved."""
        if self.distill_engine == "auto":
            return "vllm" if vllm_ready() else "hf"
        return self.distill_engine


def overrides(knobs: RecipeKnobs) -> dict[str, list[str]]:
    """``{"train", "tune", "tune_eagle3", "evaluate"}``: each command's overrides (a second drafter trained with the
    same ``train`` reads the first one's replies)."""
    engine = knobs.engine()
    distill = [f"data.self_distill_engine={engine}"]
    if engine == "vllm":
        distill.append(f"data.self_distill_dtype={knobs.distill_dtype}")
    train = [f"model={knobs.model_preset}", f"model.dtype={knobs.model_dtype}", "data=sharegpt",
             "data.self_distill=true", *distill, *knobs.data_extra,
             f"data.max_conversations={knobs.conversations}", "data.max_prompt_tokens=128", "data.max_new_tokens=192",
             "data.generation_batch_size=128", "data.eval_fraction=0.03", "max_length=320", "hidden_cache=true",
             f"heads.head_vocab_size={knobs.head_vocab}", "trainer=cpu", f"trainer.precision={knobs.precision}",
             "trainer.learning_rate=2e-3", f"trainer.num_train_epochs={knobs.epochs}",
             "trainer.per_device_train_batch_size=8", "trainer.save_steps=100"]
    # 8 timed prompts: on 4, the composite tree's splits differed by less than their noise (2026-12-02, a fresh clone)
    tune = [f"dtype={knobs.dtype}", f"prompts.num_prompts={knobs.tune_prompts}", "max_new_tokens=96",
            "latency_sizes=[1,2,4,8,12,16,24,32]", "max_nodes=31", "repeats=3", "timed_prompts=8"]
    # EAGLE-3's tree: the EAGLE-2 dynamic tree beside the static ones (a short shortlist: depths 3 and 5, top-8)
    tune_eagle3 = ["dynamic_depths=[3,5]", "dynamic_topks=[8]"]
    evaluate = ["prompts=mt_bench", "per_category=1", "max_turns=1", f"max_new_tokens={knobs.eval_tokens}",
                f"dtype={knobs.dtype}"]
    return {"train": train, "tune": tune, "tune_eagle3": tune_eagle3, "evaluate": evaluate}


def engine_line(knobs: RecipeKnobs) -> str:
    """The log's line naming the self-distillation engine (and how to install vLLM's when it is absent)."""
    engine = knobs.engine()
    how = f"dtype {knobs.distill_dtype}" if engine == "vllm" else "the fp32 training model"
    line = f"== self-distillation engine: {engine} ({how})"
    if not vllm_ready():
        line += " - vLLM's environment is not installed: bash launch/install_vllm.sh makes it"
    return line


def bash_lines(knobs: RecipeKnobs) -> str:
    """The settings as bash: one array per command (``train=(...)``), ``engine``, ``vllm_ready`` and the function
    ``resumes DIR`` (prints true when DIR holds what a killed run left: :func:`resumes`)."""
    lines = [f"{name}=({' '.join(shlex.quote(v) for v in values)})" for name, values in overrides(knobs).items()]
    lines += [f"engine={knobs.engine()}", f"vllm_ready={'true' if vllm_ready() else 'false'}"]
    found = " || ".join(f'-d "$1/{name}"' for name in RESUME_MARKERS)
    lines.append(f"resumes() {{ [[ {found} ]] && echo true || echo false; }}")
    return "\n".join(lines) + "\n"


def positive(text: str) -> int:
    """``text`` as a positive integer of at most 9 ASCII digits (no sign, space or other digits).

    Raises:
        argparse.ArgumentTypeError: anything else (``"{text}: give a positive integer"``).
    """
    if not re.fullmatch(r"[1-9][0-9]{0,8}", text):
        raise argparse.ArgumentTypeError(f"{text}: give a positive integer")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=positive, required=True)
    parser.add_argument("--epochs", type=positive, required=True)
    parser.add_argument("--head-vocab", type=positive, default=RecipeKnobs.head_vocab)
    parser.add_argument("--dtype", default=RecipeKnobs.dtype)
    parser.add_argument("--tune-prompts", type=positive, default=RecipeKnobs.tune_prompts)
    parser.add_argument("--eval-tokens", type=positive, default=RecipeKnobs.eval_tokens)
    parser.add_argument("--precision", default=RecipeKnobs.precision)
    parser.add_argument("--distill-engine", choices=DISTILL_ENGINES, default=RecipeKnobs.distill_engine)
    parser.add_argument("--distill-dtype", default=RecipeKnobs.distill_dtype)
    args = parser.parse_args(argv)
    knobs = RecipeKnobs(**{k: v for k, v in vars(args).items()})
    print(engine_line(knobs), file=sys.stderr)
    sys.stdout.write(bash_lines(knobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
