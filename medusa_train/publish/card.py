"""The model card (``README.md``) of a published export: YAML metadata the Hub indexes, then the text.

Metadata (huggingface_hub's ``ModelCardData``, so the field names are the Hub's): ``base_model`` (only when the
export names a Hub id), ``library_name: medusa-train``, ``license`` (the base model's, see
:func:`~medusa_train.publish.hub.base_model_license`), ``tags``, ``pipeline_tag`` and, with an evaluation, a
``model-index`` with the Medusa decoder's speedup, mean accepted tokens, tokens per second and exact match.

Text: what the heads are, what is missing (no tree, no evaluation, no ``vllm/``), the evaluation table and plots,
the tree, the head accuracy table, the heads' shape, the training settings, the files, how to load them with this
project, with vLLM and with FasterDecoding / TGI, the license and the citation.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml
from huggingface_hub import EvalResult, ModelCardData

from medusa_train.export.base_model import BASE_DIR
from medusa_train.export.layouts import fasterdecoding_limitation, tgi_limitation
from medusa_train.export.writer import LEGACY_WEIGHTS_FILE, TOKEN_MAP_FILE
from medusa_train.loading.export import ORIGINAL_BASE_KEY
from medusa_train.publish.folder import ExportContents
from medusa_train.loading.hub import is_hub_id
from medusa_train.publish.hub import LicenseInfo
from medusa_train.publish.local_paths import check_model_name, public_name

LIBRARY_NAME = "medusa-train"
TAGS = ["medusa", "speculative-decoding", "medusa-train"]
PLACEHOLDER_REPO = "<namespace>/<name>"
UNKNOWN_LICENSE = "unknown"
MEDUSA_PAPER = "https://arxiv.org/abs/2401.10774"
# summary.json decoder field -> (model-index metric type, display name)
EVAL_METRICS = {
    "speedup": ("speedup", "Speedup over plain greedy decoding"),
    "mean_accepted_tokens": ("mean_accepted_tokens", "Mean accepted tokens per target forward pass"),
    "tokens_per_second": ("tokens_per_second", "Tokens per second"),
    "exact_match_vs_greedy": ("exact_match", "Exact match with plain greedy output"),
}
CITATION = """@inproceedings{cai2024medusa,
  title     = {Medusa: Simple {LLM} Inference Acceleration Framework with Multiple Decoding Heads},
  author    = {Cai, Tianle and Li, Yuhong and Geng, Zhengyang and Peng, Hongwu and Lee, Jason D. and Chen, Deming
               and Dao, Tri},
  booktitle = {Proceedings of the 41st International Conference on Machine Learning},
  year      = {2024}
}"""


def card_metadata(contents: ExportContents, repo_id: str | None, license_info: LicenseInfo | None) -> dict[str, Any]:
    """The card's YAML metadata as a mapping (see the module docstring)."""
    base = hub_base(contents)
    license_info = license_info or LicenseInfo(UNKNOWN_LICENSE)
    tags = TAGS + (["vllm"] if contents.has_vllm else [])
    data = ModelCardData(
        base_model=base if contents.base_is_hub_id and is_hub_id(base) else None,
        library_name=LIBRARY_NAME,
        license=license_info.license,
        license_name=license_info.name,
        license_link=license_info.link,
        tags=tags,
        pipeline_tag="text-generation",
    )
    results = _eval_results(contents.eval_summary)
    if results:  # model-index: the Hub's structured evaluation results, named after the repository
        data.model_name, data.eval_results = repo_id or PLACEHOLDER_REPO, results
    return data.to_dict()


def _eval_results(summary: dict[str, Any] | None) -> list[EvalResult]:
    decoders = (summary or {}).get("decoders", {})
    medusa = decoders.get("tree", decoders.get("medusa"))  # the tree decoder's row, under its old name before
    if not isinstance(medusa, dict):
        return []
    prompts = summary.get("prompts")
    dataset = str(summary.get("prompt_set") or summary.get("prompts_source") or "evaluation prompts")
    results = []
    for field, (metric, name) in EVAL_METRICS.items():
        value = medusa.get(field)
        if not _is_number(value):
            continue
        if field == "tokens_per_second":
            name = f"{name} ({summary.get('device', '?')}, {summary.get('dtype', '?')})"
        results.append(EvalResult(
            task_type="text-generation", task_name="Speculative decoding",
            dataset_type=dataset.replace(" ", "_"),
            dataset_name=f"{dataset} ({prompts} prompts)" if prompts else dataset,
            metric_type=metric, metric_name=name, metric_value=round(float(value), 4),
        ))
    return results


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def render_card(contents: ExportContents, repo_id: str | None, license_info: LicenseInfo | None) -> str:
    """The whole ``README.md``: ``---`` + YAML metadata + ``---`` + the text.

    Raises:
        ValueError: the metadata does not read back as the same YAML mapping (never expected; checked before upload).
    """
    meta = card_metadata(contents, repo_id, license_info)
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    if yaml.safe_load(front) != meta:
        raise ValueError("model card metadata does not round-trip through YAML")
    repo = repo_id or PLACEHOLDER_REPO
    sections = [
        _intro(contents),
        _missing(contents),
        _evaluation(contents),
        _tree(contents),
        _accuracy(contents),
        _heads(contents),
        _training(contents),
        _usage(contents, repo),
        _files(contents),
        _license(contents, license_info),
        f"## Citation\n\n```bibtex\n{CITATION}\n```\n",
    ]
    return f"---\n{front}---\n\n" + "\n".join(s for s in sections if s)


# ---------------------------------------------------------------- sections


def is_medusa2(contents: ExportContents) -> bool:
    """Whether the export carries its own fine-tuned base (Medusa-2, ``base/``)."""
    return f"{BASE_DIR}/config.json" in contents.files


def hub_base(contents: ExportContents) -> str:
    """The base model the card names: the recorded base, or for Medusa-2 the model the fine-tuned ``base/`` started
    from (``original_base_model_name_or_path``)."""
    key = ORIGINAL_BASE_KEY if is_medusa2(contents) else "base_model_name_or_path"
    return str(contents.config.get(key) or "")


def _base_link(contents: ExportContents) -> str:
    base = hub_base(contents) or "?"
    if contents.base_is_hub_id and is_hub_id(base):
        return f"[`{base}`](https://huggingface.co/{base})"
    return f"`{base}` (a local path)"


def _local_name(contents: ExportContents) -> str:
    """The local base's file or folder name in backticks, or ``a local folder`` when it is no model name (a name
    holding a newline or markup never reaches the card)."""
    name = public_name(contents.original_base)
    try:
        return f"`{check_model_name(name, 'the local base', '')}`"
    except ValueError:
        return "a local folder"


def _intro(contents: ExportContents) -> str:
    c = contents.config
    k, layers = c["medusa_num_heads"], c.get("medusa_num_layers", 1)
    text = (f"# Medusa heads for {hub_base(contents) or 'a causal LM'}\n\n"
            f"{k} [Medusa]({MEDUSA_PAPER}) heads ({layers} residual block{'s' if layers != 1 else ''} each, "
            f"`{c.get('torch_dtype', '?')}`) for {_base_link(contents)}, trained with `medusa-train`. "
            "Head k reads the base model's last hidden state at position t and predicts the token at t+k+2; when "
            "decoding, a tree of the heads' guesses is verified in one forward pass of the base model, and greedy "
            "verification returns exactly the base model's greedy output in fewer passes (Cai et al., 2024, "
            "Sec. 2).\n")
    if is_medusa2(contents):
        text += (f"\n> Medusa-2: the heads were trained jointly with a fine-tuned copy of {_base_link(contents)}, "
                 f"published in `{BASE_DIR}/` (adapters merged). Use that folder as the base model: the heads fit it, "
                 "not the original.\n")
    elif not contents.base_is_hub_id or not is_hub_id(str(c.get("base_model_name_or_path", ""))):
        text += (f"\n> The base model was a local path ({_local_name(contents)}) when these heads were "
                 "exported, and no Hub id was given, so loaders cannot fetch it: pass the base model yourself "
                 "(`model.name_or_path=...`), or publish again with `base_model=<hub id>`.\n")
    elif contents.original_base and contents.original_base != c.get("base_model_name_or_path"):
        text += (f"\n> Trained on a local copy of the base model ({_local_name(contents)}), "
                 f"published as `{c['base_model_name_or_path']}`.\n")
    return text


def _missing(contents: ExportContents) -> str:
    if not contents.missing:
        return ""
    return "## What is missing\n\n" + "".join(f"- {note}\n" for note in contents.missing)


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return "–" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if _is_number(value):
        return f"{value:.{digits}f}"
    return str(value)


def _evaluation(contents: ExportContents) -> str:
    summary = contents.eval_summary
    if summary is None:
        return ""
    rows = ["| decoder | tokens/s | speedup | mean accepted tokens | exact match vs greedy | new tokens |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, d in summary["decoders"].items():
        d = d if isinstance(d, dict) else {}
        rows.append(f"| {name} | {_fmt(d.get('tokens_per_second'), 1)} | {_fmt(d.get('speedup'))} | "
                    f"{_fmt(d.get('mean_accepted_tokens'))} | {_fmt(d.get('exact_match_vs_greedy'))} | "
                    f"{_fmt(d.get('new_tokens'))} |")
    text = ("## Evaluation\n\n"
            f"`medusa-eval` on {_fmt(summary.get('prompts'))} prompts, {_fmt(summary.get('max_new_tokens'))} new "
            f"tokens at most, model `{summary.get('model', '?')}` on `{summary.get('device', '?')}` in "
            f"`{summary.get('dtype', '?')}`. Speedup is tokens per second over plain greedy decoding's in the same "
            "run; mean accepted tokens counts new tokens per target forward pass (plain decoding: 1.0).\n\n"
            + "\n".join(rows) + "\n")
    for plot in contents.eval_plots:
        text += f"\n![{plot.rsplit('/', 1)[-1].removesuffix('.png')}]({plot})\n"
    if contents.eval_markdown:
        text += (f"\n<details><summary>eval/summary.md</summary>\n\n{contents.eval_markdown.strip()}\n\n"
                 "</details>\n")
    return text


def _tree(contents: ExportContents) -> str:
    choices = contents.tree.get("medusa_choices")
    if choices is None:
        return ""
    latency = contents.tree.get("latency_profile")
    timed = isinstance(latency, dict) and (latency.get("chosen") or {}).get("by") == "timed"
    tuned = (f" Tuned by `medusa-tune-tree` for `{latency.get('device', '?')}` in `{latency.get('dtype', '?')}` "
             "from the head accuracies and the verification latency of each tree size"
             + (", the sizes predicted best then decoded on tuning prompts" if timed else "")
             + " (`latency_profile.json`)." if isinstance(latency, dict) else "")
    depth = max((len(p) for p in choices), default=0)
    width = max((max(p) for p in choices if p), default=-1) + 1
    return (f"## Tree (`medusa_choices.json`)\n\n"
            f"{len(choices)} nodes, depth {depth}, top-{width} candidates at most per head.{tuned} "
            "Path `[i, j]` is head 0's rank-i token followed by head 1's rank-j token.\n\n"
            f"<details><summary>medusa_choices</summary>\n\n```json\n{json.dumps(choices)}\n```\n\n</details>\n")


def _accuracy(contents: ExportContents) -> str:
    table = contents.tree.get("head_accuracy")
    if not isinstance(table, dict):
        return ""
    top1, topn, n, source = _accuracy_columns(table)
    if top1 is None:
        return "## Head accuracy\n\n`head_accuracy.json` is included (format not summarised here).\n"
    rows = [f"| head | predicts | top-1 | top-{n} |", "| ---: | --- | ---: | ---: |"]
    for k, (a1, a5) in enumerate(zip(top1, topn)):
        rows.append(f"| {k} | token t+{k + 2} | {_fmt(a1, 3)} | {_fmt(a5, 3)} |")
    return f"## Head accuracy\n\n{source}\n\n" + "\n".join(rows) + "\n"


def _accuracy_columns(table: dict[str, Any]) -> tuple[list[Any] | None, list[Any] | None, int, str]:
    """(top-1 per head, top-n per head, n <= 5, where it was measured) from either accuracy file format."""
    acc = table.get("acc")
    if isinstance(acc, list) and all(isinstance(row, list) and row for row in acc):
        # medusa-tune-tree: acc[k][i] = P(head k's rank-i token is the right one); ranks exclude each other
        n = min(5, min(len(row) for row in acc))
        source = (f"Measured by `medusa-tune-tree` on the base model's own greedy continuations of "
                  f"{_fmt(table.get('prompts'))} held-out prompts ({table.get('prompt_source', 'prompts')}).")
        return [row[0] for row in acc], [sum(row[:n]) for row in acc], n, source
    if isinstance(table.get("top1"), list):  # training: accuracy on the held-out split
        source = (f"Measured at the end of training on the held-out split ({_fmt(table.get('conversations'))} "
                  f"conversations, target `{table.get('target', '?')}`).")
        return table["top1"], table.get("top5") or [None] * len(table["top1"]), 5, source
    return None, None, 0, ""


def _heads(contents: ExportContents) -> str:
    c = contents.config
    rows = [("heads (`medusa_num_heads`)", c.get("medusa_num_heads")),
            ("residual blocks per head (`medusa_num_layers`)", c.get("medusa_num_layers")),
            ("hidden size", c.get("hidden_size")), ("vocabulary", c.get("vocab_size")),
            ("head vocabulary (`head_vocab_size`)", c.get("head_vocab_size") or "full"),
            ("projection shared with the base lm_head", c.get("share_lm_head", False)),
            ("dtype", c.get("torch_dtype")), ("export format version", c.get("version")),
            ("medusa-train version", c.get("medusa_train_version"))]
    return "## Heads\n\n| | |\n| --- | --- |\n" + "".join(f"| {k} | {_fmt(v)} |\n" for k, v in rows)


def _training(contents: ExportContents) -> str:
    training = contents.config.get("training")
    if not isinstance(training, dict) or not training:
        return "## Training\n\nThe export does not record how the heads were trained.\n"
    names = {"data_source": "data", "self_distill": "self-distillation (replies regenerated by the base model)",
             "target": "training target", "loss_decay": "loss weight decay per head", "max_length":
             "tokens per conversation", "global_step": "optimizer steps", "seed": "seed"}
    rows = "".join(f"| {names.get(k, k)} | {_fmt(v)} |\n" for k, v in training.items())
    text = f"## Training\n\n| | |\n| --- | --- |\n{rows}"
    if training.get("data_source") == "sharegpt":
        text += ("\nShareGPT conversations were collected from users' shared ChatGPT chats; their license is "
                 "unclear, so check whether that matters for your use.\n")
    return text


def _usage(contents: ExportContents, repo: str) -> str:
    c = contents.config
    base = c.get("base_model_name_or_path", "<base model>")
    k = c["medusa_num_heads"]
    local = repo.split("/")[-1]
    text = ("## Usage\n\n### medusa-train\n\n"
            "```python\n"
            "from inference.decoders.base import DecodeConfig\n"
            "from inference.decoders.tree import TreeDecoder\n"
            "from medusa_train.chat.prompts import encode_prompt\n\n"
            f'decoder = TreeDecoder.from_pretrained("{repo}")  # the heads and tree from here, the base model '
            "from base_model_name_or_path\n"
            'prompt = encode_prompt(decoder.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}])\n'
            "result = decoder.generate(prompt, DecodeConfig(max_new_tokens=256))\n"
            "print(result.text)\n"
            "```\n\n"
            "Or from the command line:\n\n"
            "```bash\n"
            f"hf download {repo} --local-dir {local}\n"
            f'medusa-generate export_dir={local} prompt="Why is the sky blue?"\n'
            "```\n")
    if contents.has_vllm:
        spec = json.dumps({"method": "medusa", "model": f"{local}/vllm", "num_speculative_tokens": k})
        layout = ""
        if c.get("head_vocab_size"):
            layout = (f"The heads project onto {c['head_vocab_size']:,} of the {c.get('vocab_size', 0):,} tokens; "
                      "vLLM (0.32) loads no token map, so `vllm/` holds full-vocabulary projections whose rows "
                      "outside the head vocabulary are the mean of the head's own rows: vLLM's argmax is then "
                      "exactly the head's top-1 (measured in the medusa-train repository's docs/vllm.md), at the "
                      "cost of a larger file (one vocabulary-sized matrix per projection). ")
        text += ("\n### vLLM\n\n"
                 "`vllm/` holds the heads in vLLM's Medusa layout (`model_type: medusa`). vLLM drafts one chain, "
                 f"each head's top-1 token, so `num_speculative_tokens` is the number of heads ({k}). "
                 f"{layout}\n\n"
                 "```bash\n"
                 f'hf download {repo} --include "vllm/*" --local-dir {local}\n'
                 f"vllm serve {base} --speculative-config '{spec}'\n"
                 "```\n\n"
                 "```python\n"
                 "from vllm import LLM, SamplingParams\n\n"
                 f'llm = LLM(model="{base}", speculative_config={spec})\n'
                 'print(llm.generate(["Why is the sky blue?"], SamplingParams(temperature=0, max_tokens=256))[0]'
                 ".outputs[0].text)\n"
                 "```\n")
    return text + _engines(contents, repo)


def _engines(contents: ExportContents, repo: str) -> str:
    """What FasterDecoding's loader and TGI need, and whether they can use these heads."""
    c, spec = contents.config, contents.spec
    base = c.get("base_model_name_or_path", "<base model>")
    text = ("\n### FasterDecoding Medusa and Text Generation Inference\n\n"
            "The top level of this repository is in FasterDecoding's layout: `config.json` with `medusa_num_heads`, "
            "`medusa_num_layers` and `base_model_name_or_path` (the base model both load; no `architectures`, with "
            "which TGI would not take it for Medusa heads), and the heads under the keys "
            "`{h}.{l}.linear.weight|bias` and `{h}.{L}.weight`."
            + ("" if contents.base_is_hub_id else f" `{base}` is a local file's name: set `base_model_name_or_path` "
               "to a base model they can load first.") + "\n\n")
    if spec is not None and spec.head_vocab_size is not None:
        text += (f"These heads predict over a reduced vocabulary of {spec.head_vocab_size} of the base model's "
                 f"{spec.vocab_size} tokens, mapped to token ids by `{TOKEN_MAP_FILE}`. FasterDecoding and Text "
                 "Generation Inference read no token map, so they cannot use these heads: the reduced vocabulary is "
                 "for loaders that apply the map, medusa-train's `TreeDecoder` and vLLM's Medusa (`vllm/`, "
                 "`truncated_vocab_size` with `token_map`).\n")
        return text
    fd_reason = fasterdecoding_limitation(spec) if spec is not None else None
    if LEGACY_WEIGHTS_FILE in contents.files and fd_reason is None:
        shared = ", each head's projection being the base lm_head, as these heads share it" \
            if spec is not None and spec.share_lm_head else ""
        text += ("- **FasterDecoding** (`pip install medusa-llm`, Llama bases): "
                 f"`MedusaModel.from_pretrained(\"{repo}\")` builds the base model `{base}` and loads "
                 f"`{LEGACY_WEIGHTS_FILE}` (a `torch.save` of the heads{shared}).\n")
    else:
        why = fd_reason or f"this export has no `{LEGACY_WEIGHTS_FILE}` (re-export with medusa-train to write it)"
        text += f"- **FasterDecoding** cannot load these heads: {why}.\n"
    tgi_reason = tgi_limitation(spec) if spec is not None else None
    if tgi_reason is None:
        shared = (" It projects every head with the base model's lm_head, as these heads were trained to."
                  if spec is not None and spec.share_lm_head else "")
        text += (f"- **Text Generation Inference**: `--model-id {repo}` serves `{base}` with these heads "
                 f"(`medusa_lm_head.safetensors`, up to `--speculate {c['medusa_num_heads']}`).{shared}\n")
    else:
        text += f"- **Text Generation Inference** cannot serve these heads: {tgi_reason}.\n"
    return text


def _files(contents: ExportContents) -> str:
    what = {
        "config.json": "heads config (FasterDecoding / TGI fields and sizes)",
        "medusa_lm_head.safetensors": "the heads (FasterDecoding layout)",
        "medusa_lm_head.pt": "the heads (FasterDecoding layout, PyTorch pickle)",
        "token_map.safetensors": "head-vocabulary index -> base token id",
        "vllm/config.json": "vLLM Medusa config",
        "vllm/model.safetensors": "the heads in vLLM's layout",
        "medusa_choices.json": "the tuned tree",
        "head_accuracy.json": "head accuracy table",
        "latency_profile.json": "verification latency by tree size (device, dtype)",
        "eval/summary.json": "evaluation summary",
        "eval/summary.md": "evaluation report",
    }
    rows = "".join(f"| `{p}` | {what.get(p, 'evaluation plot' if p.endswith('.png') else '')} |\n"
                   for p in sorted(contents.files))
    return f"## Files\n\n| file | holds |\n| --- | --- |\n{rows}"


def _license(contents: ExportContents, license_info: LicenseInfo | None) -> str:
    if license_info is None:
        return ("## License\n\nThe base model's license could not be determined (`license: unknown`). These heads "
                "were trained on the base model's outputs: check its license before using or sharing them.\n")
    name = f"{license_info.license}" + (f" ({license_info.name})" if license_info.name else "")
    link = f" See {license_info.link}." if license_info.link else ""
    source = f" ({license_info.source})" if license_info.source else ""
    return (f"## License\n\n`{name}`{source}. The heads derive from the base model {_base_link(contents)}, so its "
            f"terms apply.{link}\n")
