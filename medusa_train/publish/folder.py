"""Assemble the Hub repository folder of an export: the files engines load, the tree, the evaluation, the card.

Repository layout (the export layout of :mod:`medusa_train.export.writer` plus the tree and the evaluation):

```
config.json                  FasterDecoding / TGI config (base_model_name_or_path may be replaced, see below)
medusa_lm_head.safetensors   the heads (TGI and medusa-train read it)
medusa_lm_head.pt            the same heads for FasterDecoding's loader, when the export has it (checked equal)
token_map.safetensors        only with a reduced head vocabulary
vllm/config.json, vllm/model.safetensors
base/...                     Medusa-2 only: the fine-tuned base (LoRA merged) the heads were trained with
medusa_choices.json, head_accuracy.json, latency_profile.json      when tuned
eval/summary.json, eval/summary.md, eval/*.png                     when evaluated
README.md                    the model card
```

Only these files are published: other things in the export folder (Hydra run folders, checkpoints, notes) stay
local. The export itself is never modified. Local absolute paths are not published
(:mod:`~medusa_train.publish.local_paths`): the base model is named by its Hub id when one is known, else by its file
or folder name, and ``config.json``, ``eval/summary.json`` and ``eval/summary.md`` are written with every other
absolute path cut to its last component. Heads holding NaN or Inf are refused before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.export import BASE_DIR, load_heads, read_export_config
from medusa_train.models.catalog import MEDUSA_LAYOUT, drafter_type, drafter_types, titles
from medusa_train.export.configs import export_head_type
from medusa_train.export.reader import check_fasterdecoding_copy
from medusa_train.export.writer import (
    CONFIG_FILE,
    LEGACY_WEIGHTS_FILE,
    TOKEN_MAP_FILE,
    VLLM_DIR,
    VLLM_WEIGHTS_FILE,
    WEIGHTS_FILE,
)
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.loading.export import EXPORT_MODEL_KEY, ORIGINAL_BASE_KEY
from medusa_train.publish.local_paths import published_base, scrub, scrub_text
from medusa_train.export.tree_files import ACCURACY_FILE, CHOICES_FILE, TREE_FILES, read_tree_files

log = logging.getLogger(__name__)

README_FILE = "README.md"
EVAL_DIR = "eval"
EVAL_SUMMARY = "summary.json"
EVAL_MARKDOWN = "summary.md"


@dataclass
class ExportContents:
    """What an export holds, read and checked, ready for the card and the folder.

    Attributes:
        export_dir: the export folder.
        config: its ``config.json`` as published (``base_model_name_or_path`` replaced when a base was given).
        config_changed: whether ``config`` differs from the file (then it is written, not copied).
        original_base: the base the export recorded (``base_model_name_or_path``; for Medusa-2 the model ``base/``
            was fine-tuned from), maybe a local path: never published; the license lookup reads a local base's
            card from it.
        files: repository path -> local file, README excluded.
        tree: :func:`~medusa_train.export.tree_files.read_tree_files` of the export.
        spec: the heads' shape (from the strict load).
        base_is_hub_id: whether the published base (``hub_base``) is a Hub id; False: a local file or folder's name.
        eval_summary: ``summary.json`` of the evaluation as published, or None.
        eval_markdown: ``summary.md`` of the evaluation as published, or None.
        eval_plots: repository paths of the evaluation's PNG plots.
        rewritten: repository path -> text written instead of copying the file (local paths taken out).
        missing: one sentence per missing part (tree, accuracy table, evaluation, vLLM folder), for the card.
    """

    export_dir: Path
    config: dict[str, Any]
    config_changed: bool
    original_base: str
    files: dict[str, Path]
    tree: dict[str, Any]
    spec: HeadsSpec | None = None
    base_is_hub_id: bool = True
    eval_summary: dict[str, Any] | None = None
    eval_markdown: str | None = None
    eval_plots: list[str] = field(default_factory=list)
    rewritten: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def has_vllm(self) -> bool:
        return f"{VLLM_DIR}/{CONFIG_FILE}" in self.files


def collect_export(
    export_dir: str | os.PathLike[str], eval_dir: str | os.PathLike[str] | None = None, base_model: str | None = None
) -> ExportContents:
    """Read and check an export before anything is written or uploaded.

    The heads are loaded strictly (every key and shape, :func:`~medusa_train.export.load_heads`), and so is
    ``vllm/`` when present, so a damaged export fails here rather than on the Hub.

    Args:
        export_dir: the export folder.
        eval_dir: a ``medusa-eval`` output folder; default ``export_dir/eval`` when it exists (a warning otherwise).
        base_model: Hub id to publish as ``base_model_name_or_path`` (for exports trained on a local copy); a
            recorded ``medusa_train_model`` naming another path (how the local copy was loaded) is then dropped
            from the published config, so loaders use the Hub id. For a Medusa-2 export (``base/``, the fine-tuned
            base the heads fit) it is written as ``original_base_model_name_or_path`` instead: the model ``base/``
            was fine-tuned from, named by the card, while loaders keep using ``base/``.

    Raises:
        FileNotFoundError: no export there, or ``eval_dir`` given without a ``summary.json``.
        ValueError: damaged weights or JSON files (the file named), heads holding NaN or Inf (tensor and head
            named), a ``medusa_lm_head.pt`` that differs from the safetensors file, no base model named (neither
            ``base_model_name_or_path`` nor ``base_model``), or an invalid ``medusa_choices.json``.
    """
    folder = Path(export_dir)
    config = read_export_config(folder)  # FileNotFoundError / ValueError naming the folder
    head_type = export_head_type(config)
    entry = drafter_type(head_type, f"{folder}/config.json")
    if entry.layout != MEDUSA_LAYOUT:
        published = titles(e for e in drafter_types() if e.layout == MEDUSA_LAYOUT)
        raise ValueError(f"{folder} holds {head_type} heads (head_type {head_type!r}): medusa-publish publishes "
                         f"{published} heads in the FasterDecoding, TGI and vLLM layouts, which have no form for these")
    heads, _ = load_heads(folder, head_type=head_type)  # strict: missing keys, shapes, damaged files, NaN / Inf
    files: dict[str, Path] = {CONFIG_FILE: folder / CONFIG_FILE}
    weights = next(n for n in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE) if (folder / n).is_file())
    files[weights] = folder / weights
    if check_fasterdecoding_copy(folder):  # FasterDecoding's loader downloads the .pt: it must hold the same heads
        files[LEGACY_WEIGHTS_FILE] = folder / LEGACY_WEIGHTS_FILE
    if config.get("head_vocab_size") is not None:
        files[TOKEN_MAP_FILE] = folder / TOKEN_MAP_FILE
    missing: list[str] = []
    vllm = folder / VLLM_DIR
    if (vllm / CONFIG_FILE).is_file():
        load_heads(vllm)
        for name in (CONFIG_FILE, VLLM_WEIGHTS_FILE):
            files[f"{VLLM_DIR}/{name}"] = vllm / name
    else:
        missing.append(f"No `{VLLM_DIR}/` folder: these heads cannot be served with vLLM as published; re-export "
                       "with `export_vllm=true` and publish again.")

    base_dir = folder / BASE_DIR
    if base_dir.is_dir():  # Medusa-2: the heads fit this fine-tuned base only, so it travels with them
        for path in sorted(p for p in base_dir.rglob("*") if p.is_file()):
            files[path.relative_to(folder).as_posix()] = path

    tree = read_tree_files(folder)
    _check_choices(tree.get("medusa_choices"), folder / CHOICES_FILE)
    for name in TREE_FILES.values():  # the tuned files: tree, accuracy, latency, dynamic and composite trees
        if (folder / name).is_file():
            files[name] = folder / name
    if "medusa_choices" not in tree:
        missing.append(f"No tuned tree (`{CHOICES_FILE}`): `TreeDecoder` falls back to Medusa's default "
                       "`mc_sim_7b_63` tree cut to these heads. Run `medusa-tune-tree export_dir=EXPORT_DIR` and "
                       "publish again.")
    if "head_accuracy" not in tree:
        missing.append(f"No head accuracy table (`{ACCURACY_FILE}`): it is written by training (with a held-out "
                       "split) and by `medusa-tune-tree`.")

    contents = ExportContents(folder, config, False, str(config.get("base_model_name_or_path", "")), files, tree,
                              spec=heads.spec, missing=missing)
    recorded_model = config.get(EXPORT_MODEL_KEY)
    if (base_dir / CONFIG_FILE).is_file():
        # Medusa-2: the heads fit the fine-tuned base in base/, so base_model_name_or_path stays; the Hub id names
        # the model it was fine-tuned from (the card's base_model)
        original = str(config.get(ORIGINAL_BASE_KEY) or "")
        contents.original_base = original
        name, contents.base_is_hub_id = published_base(original, recorded_model, base_model)
        published = dict(config, **{ORIGINAL_BASE_KEY: name}) if original or base_model else dict(config)
        renamed = {original: name}
    else:
        if not base_model and not contents.original_base:
            raise ValueError(f"{folder / CONFIG_FILE} has no base_model_name_or_path: FasterDecoding, TGI and "
                             "medusa-train load the base model from it; add \"base_model_name_or_path\": \"<Hub "
                             "id>\" to that file, or publish with base_model=<Hub id>")
        name, contents.base_is_hub_id = published_base(contents.original_base, recorded_model, base_model)
        published = dict(config, base_model_name_or_path=name)
        if isinstance(recorded_model, dict) and recorded_model.get("name_or_path") != name:
            del published[EXPORT_MODEL_KEY]  # how a local copy was loaded: meaningless elsewhere
        renamed = {contents.original_base: name}
    published = scrub(published)  # any other local path (e.g. training.init_from): its last component
    contents.config, contents.config_changed = published, published != config
    _collect_eval(contents, eval_dir, renamed)
    for note in contents.missing:
        log.warning("publishing %s: %s", folder, note)
    return contents


def _check_choices(choices: Any, path: Path) -> None:
    if choices is None:
        return
    if not isinstance(choices, list) or not all(
        isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
        for p in choices
    ):
        raise ValueError(f"{path} must hold a list of rank paths such as [[0], [0, 0], [1]], got {choices!r:.200}")


def _collect_eval(contents: ExportContents, eval_dir: str | os.PathLike[str] | None,
                  renamed: dict[str, str]) -> None:
    default = contents.export_dir / EVAL_DIR
    folder = Path(eval_dir) if eval_dir is not None else default
    summary = folder / EVAL_SUMMARY
    if not summary.is_file():
        if eval_dir is not None:
            raise FileNotFoundError(f"eval_dir={folder} has no {EVAL_SUMMARY}: pass the output_dir of a medusa-eval "
                                    "run, or leave eval_dir unset")
        contents.missing.append(f"No evaluation (`{EVAL_DIR}/{EVAL_SUMMARY}`): no measured speedup is published. "
                                "Run `medusa-eval export_dir=EXPORT_DIR prompts=FILE output_dir=EXPORT_DIR/eval` "
                                "(or publish with `eval_dir=`) and publish again.")
        return
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{summary} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("decoders"), dict):
        raise ValueError(f"{summary} must be a medusa-eval summary with a 'decoders' mapping")
    # the model it names is the export's base: published under the same name as in config.json
    published = scrub(dict(data, model=renamed.get(data.get("model"), data.get("model"))))
    contents.eval_summary = published
    contents.files[f"{EVAL_DIR}/{EVAL_SUMMARY}"] = summary
    if published != data:
        contents.rewritten[f"{EVAL_DIR}/{EVAL_SUMMARY}"] = json.dumps(published, indent=2) + "\n"
    if (folder / EVAL_MARKDOWN).is_file():
        text = (folder / EVAL_MARKDOWN).read_text(encoding="utf-8")
        for old, new in renamed.items():
            text = text.replace(old, new) if old else text
        contents.eval_markdown = scrub_text(text)
        contents.files[f"{EVAL_DIR}/{EVAL_MARKDOWN}"] = folder / EVAL_MARKDOWN
        if contents.eval_markdown != (folder / EVAL_MARKDOWN).read_text(encoding="utf-8"):
            contents.rewritten[f"{EVAL_DIR}/{EVAL_MARKDOWN}"] = contents.eval_markdown
    for plot in sorted(folder.glob("*.png")):
        contents.files[f"{EVAL_DIR}/{plot.name}"] = plot
        contents.eval_plots.append(f"{EVAL_DIR}/{plot.name}")


def write_repo_folder(
    contents: ExportContents, card: str, out_dir: str | os.PathLike[str], link: bool = False
) -> list[str]:
    """Write the repository folder: every file of ``contents`` plus ``README.md`` = ``card``.

    Args:
        contents: from :func:`collect_export`.
        card: the model card text.
        out_dir: created if absent; must be empty.
        link: hard-link the files instead of copying them (a private staging folder for the upload: no copy of
            large weights); falls back to copying across file systems.

    Returns:
        The repository paths written, sorted.

    Raises:
        ValueError: ``out_dir`` is not empty, or lies inside the export folder.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output_dir {out} is not an empty folder: choose a new one or empty it")
    if out.resolve().is_relative_to(contents.export_dir.resolve()):
        raise ValueError(f"output_dir {out} is inside the export folder {contents.export_dir}: choose another place")
    out.mkdir(parents=True, exist_ok=True)
    for repo_path, source in contents.files.items():
        target = out / repo_path
        target.parent.mkdir(parents=True, exist_ok=True)
        if repo_path == CONFIG_FILE and contents.config_changed:
            target.write_text(json.dumps(contents.config, indent=2) + "\n", encoding="utf-8")
        elif repo_path in contents.rewritten:
            target.write_text(contents.rewritten[repo_path], encoding="utf-8")
        elif link:
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
        else:
            shutil.copyfile(source, target)
    (out / README_FILE).write_text(card, encoding="utf-8")
    return sorted([*contents.files, README_FILE])
