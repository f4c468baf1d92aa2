"""Publishing to the Hub against a local Hub server (tests/hub_server.py): byte-for-byte round trips, the model card's
metadata, resuming after a network failure, tokens never shown, and loading back (heads, the vllm/ folder, decoder)."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
import traceback
import types
from pathlib import Path

import huggingface_hub.constants
import huggingface_hub.utils._http
import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.decoders.pretrained import pretrained_decoder_kwargs
from medusa_train.cli.publish import register_schemas
from medusa_train.export import load_heads, save_base_model, save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.loading.hub import download_export
from medusa_train.files.paths import CONF_DIR
from medusa_train.publish import PublishError, check_publish_ready, prepare_repo_folder, publish_export
from tests.conftest import HIDDEN, VOCAB, make_tiny_model, make_tiny_tokenizer
from tests.hub_server import HubServer, readme_metadata

register_schemas()  # what conf/publish.yaml composes from

TOKEN = "hf_TestTokenAlice0123456789"
REPO = "alice/tiny-medusa"
BASE = "alice/tiny-base"
TOKEN_MAP = torch.tensor([0, 2, 5, 11, 17, 40, 41, 96])
CHOICES = [[0], [0, 0], [1], [0, 1], [0, 0, 0]]
ACCURACY = {"acc": [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1], [0.2, 0.1, 0.1]], "positions": [90, 89, 88], "prompts": 4,
            "new_tokens": 96, "topk": 3, "prompt_source": "mt_bench"}
LATENCY = {"device": "cpu", "dtype": "float32", "context_length": 64, "repeats": 3,
           "latency_ms": {"1": 2.0, "4": 2.5}, "predicted": {"1": 0.5, "4": 0.9}}
SUMMARY = {"model": BASE, "device": "cpu", "dtype": "float32", "prompts": 4, "max_new_tokens": 32,
           "decoders": {"vanilla": {"tokens_per_second": 50.0, "speedup": 1.0, "mean_accepted_tokens": 1.0,
                                    "exact_match_vs_greedy": 1.0, "new_tokens": 128, "wall_time_s": 2.56},
                        "medusa": {"tokens_per_second": 90.0, "speedup": 1.8, "mean_accepted_tokens": 2.25,
                                   "exact_match_vs_greedy": 1.0, "new_tokens": 128, "wall_time_s": 1.42}}}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))  # copied as bytes, never decoded
HEADS_COMMIT = ["config.json", "medusa_lm_head.safetensors", "token_map.safetensors", "vllm/config.json",
                "vllm/model.safetensors"]
REST_COMMIT = ["README.md", "composite_tree.json", "eval/speedup.png", "eval/summary.json", "eval/summary.md",
               "head_accuracy.json", "latency_profile.json", "medusa_choices.json"]
COMPOSITE = {"nodes": 6, "lookup_length": 2, "lookup_matches": 1, "max_matching_ngram_size": 2, "heads_nodes": 4,
             "medusa_choices": [[0], [1], [0, 0], [2], [0, 1], [1, 0]], "tokens_per_s": None,
             "mean_accepted_tokens": None, "chosen": {"by": "default"}}


def tree_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def heads() -> MedusaHeads:
    heads = MedusaHeads(HeadsSpec(3, 1, HIDDEN, VOCAB, head_vocab_size=8), token_map=TOKEN_MAP)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return heads


def write_export(folder: Path, heads: MedusaHeads, base: torch.nn.Module, tuned: bool = True,
                 evaluated: bool = True, vllm: bool = True) -> Path:
    save_export(heads, folder, BASE, extra_config={"training": {"data_source": "sharegpt", "target": "base_argmax",
                                                                "global_step": 40, "seed": 0}},
                vllm=vllm, base_model=base)
    if tuned:
        (folder / "medusa_choices.json").write_text(json.dumps(CHOICES))
        (folder / "head_accuracy.json").write_text(json.dumps(ACCURACY))
        (folder / "latency_profile.json").write_text(json.dumps(LATENCY))
        (folder / "composite_tree.json").write_text(json.dumps(COMPOSITE))
    if evaluated:
        (folder / "eval").mkdir()
        (folder / "eval" / "summary.json").write_text(json.dumps(SUMMARY))
        (folder / "eval" / "summary.md").write_text("| decoder | speedup |\n| --- | --- |\n| medusa | 1.80 |\n")
        (folder / "eval" / "speedup.png").write_bytes(PNG)
        (folder / "eval" / "results.jsonl").write_text("{}\n")  # stays local: not part of the repository
    (folder / ".tune_tree").mkdir()  # a Hydra run folder: stays local
    return folder


@pytest.fixture(scope="module")
def export(tmp_path_factory, heads, base) -> Path:
    return write_export(tmp_path_factory.mktemp("full") / "export", heads, base)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The local Hub, with the base model's card, HF_ENDPOINT and HF_TOKEN pointing at it, and no retry sleeps."""
    server = HubServer({TOKEN: "alice"})
    server.start()
    server.add_repo(BASE, {"README.md": b"---\nlicense: apache-2.0\ntags: [llama]\n---\n# tiny base\n",
                           "config.json": b"{}"})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # tests/conftest.py sets it for the rest
    # huggingface_hub retries a failed request 5 times, sleeping 1+2+4+8+8 s: keep the retries, drop the sleeps.
    monkeypatch.setattr(huggingface_hub.utils._http, "time",
                        types.SimpleNamespace(sleep=lambda s: None, time=time.time, monotonic=time.monotonic,
                                              perf_counter=time.perf_counter))
    yield server
    server.stop()


# ---------------------------------------------------------------- publish and read back


def test_publish_then_read_back_every_file_bit_for_bit(hub, export, heads, base, tmp_path):
    result = publish_export(export, REPO)
    assert result.url == f"{hub.url}/{REPO}" and result.license == "apache-2.0" and result.missing == []
    assert result.files == sorted(HEADS_COMMIT + REST_COMMIT)

    # What the Hub stored, byte for byte: the export's own files, and the card of a dry run of the same publish.
    stored = hub.files(REPO)
    assert sorted(stored) == sorted([".gitattributes", *HEADS_COMMIT, *REST_COMMIT])
    for path in HEADS_COMMIT + REST_COMMIT[1:]:
        assert stored[path] == (export / path).read_bytes(), path
    preview = prepare_repo_folder(export, tmp_path / "preview", REPO)
    assert tree_of(preview.folder) == {p: c for p, c in stored.items() if p != ".gitattributes"}

    # Two commits: the loadable heads first, the card last; private=False by default.
    repo = hub.repos[REPO]
    assert [c.added for c in repo.commits[1:]] == [HEADS_COMMIT, REST_COMMIT]
    assert result.commits == [c.oid for c in repo.commits[1:]] and repo.private is False

    # Read back through the Hub's download API (snapshot_download), byte for byte.
    folder = download_export(REPO, cache_dir=tmp_path / "cache")
    downloaded = tree_of(folder)
    assert {p: c for p, c in downloaded.items() if p != ".gitattributes"} == tree_of(preview.folder)

    # The downloaded heads give the original logits, from the top level and from vllm/ (tests/inference/test_vllm.py
    # loads vllm/ in the real vLLM).
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = heads(x, base.lm_head.weight)
    loaded, config = load_heads(folder)
    assert config["base_model_name_or_path"] == BASE and torch.equal(loaded(x, base.lm_head.weight), expected)
    from_vllm, _ = load_heads(folder / "vllm")
    assert torch.equal(from_vllm.token_map, TOKEN_MAP) and torch.equal(from_vllm(x, base.lm_head.weight), expected)


def test_model_card_metadata_is_valid_yaml_with_base_library_tags_and_eval(hub, export):
    publish_export(export, REPO)
    card = hub.files(REPO)["README.md"].decode()
    meta = readme_metadata(card)
    assert meta["base_model"] == BASE
    assert meta["library_name"] == "medusa-train"
    assert meta["license"] == "apache-2.0"  # read from the base model's card on the Hub
    assert meta["tags"] == ["medusa", "speculative-decoding", "medusa-train", "vllm"]
    assert meta["pipeline_tag"] == "text-generation"
    (index,) = meta["model-index"]
    assert index["name"] == REPO
    metrics = {m["type"]: m["value"] for r in index["results"] for m in r["metrics"]}
    assert metrics == {"speedup": 1.8, "mean_accepted_tokens": 2.25, "tokens_per_second": 90.0, "exact_match": 1.0}
    assert index["results"][0]["dataset"] == {"name": "evaluation prompts (4 prompts)", "type": "evaluation_prompts"}
    assert hub.count("validate-yaml") == 1  # the Hub's own check of the metadata passed
    # The text: eval table and plot, tree, accuracy table, vLLM command, license.
    assert "| medusa | 90.0 | 1.80 | 2.25 | 1.00 | 128 |" in card
    assert "![speedup](eval/speedup.png)" in card
    assert "5 nodes, depth 3, top-2 candidates at most per head." in card and json.dumps(CHOICES) in card
    assert "| head | predicts | top-1 | top-3 |" in card and "| 1 | token t+3 | 0.300 | 0.600 |" in card
    assert ('--speculative-config \'{"method": "medusa", "model": "tiny-medusa/vllm", "num_speculative_tokens": 3}\''
            in card)
    assert "The heads project onto 8 of the 97 tokens; vLLM (0.32) loads no token map" in card
    assert f'TreeDecoder.from_pretrained("{REPO}")' in card
    assert "`apache-2.0` (from the alice/tiny-base model card)" in card
    assert "What is missing" not in card


def test_republishing_unchanged_export_makes_no_commit(hub, export):
    publish_export(export, REPO)
    commits = len(hub.repos[REPO].commits)
    again = publish_export(export, REPO)
    assert len(hub.repos[REPO].commits) == commits
    assert again.commits == [hub.repos[REPO].branches["main"]]


def test_private_repository_on_a_branch(hub, export, tmp_path):
    publish_export(export, REPO, private=True, revision="v1", commit_message="Tiny heads")
    repo = hub.repos[REPO]
    assert repo.private is True
    assert sorted(hub.files(REPO, "main")) == [".gitattributes"]
    assert sorted(hub.files(REPO, "v1")) == sorted([".gitattributes", *HEADS_COMMIT, *REST_COMMIT])
    assert [c.message for c in repo.commits[1:]] == ["Tiny heads (1/2: heads)",
                                                     "Tiny heads (2/2: tree, evaluation and model card)"]
    folder = download_export(REPO, revision="v1", cache_dir=tmp_path / "cache")  # with the token: private is fine
    assert (folder / "medusa_choices.json").read_bytes() == (export / "medusa_choices.json").read_bytes()


# ---------------------------------------------------------------- failures


def test_network_failure_mid_upload_says_what_was_uploaded_and_rerun_resumes(hub, export):
    hub.fail_after(1, endpoint="commit")  # the first commit lands, then every commit request is dropped
    with pytest.raises(PublishError) as info:
        publish_export(export, REPO)
    message = str(info.value)
    assert "uploading the tree, evaluation and model card of alice/tiny-medusa@main failed" in message
    assert "RemoteProtocolError" in message  # the connection dropped without an answer
    assert f"Already committed: {', '.join(HEADS_COMMIT)}." in message
    assert f"Not uploaded: {', '.join(REST_COMMIT)}." in message
    assert "Re-run the same command to resume" in message
    assert info.value.committed == HEADS_COMMIT and info.value.pending == REST_COMMIT
    assert hub.count("commit") == 7  # 1 good + the second commit tried 6 times (huggingface_hub's retries)
    assert sorted(hub.files(REPO)) == sorted([".gitattributes", *HEADS_COMMIT])

    hub.fail_after(None)
    before = len(hub.repos[REPO].commits)
    publish_export(export, REPO)
    new = hub.repos[REPO].commits[before:]
    assert [c.added for c in new] == [REST_COMMIT]  # the heads were not sent again
    assert sorted(hub.files(REPO)) == sorted([".gitattributes", *HEADS_COMMIT, *REST_COMMIT])


def test_missing_token_says_how_to_log_in(hub, export, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PublishError, match=r"no Hugging Face token found: log in with `hf auth login`.*HF_TOKEN"):
        publish_export(export, REPO)
    with pytest.raises(PublishError, match="hf auth login"):
        check_publish_ready(REPO)
    assert hub.requests == []  # refused before any request


@pytest.mark.parametrize("repo_id,message", [
    ("tiny-medusa", "must be 'namespace/name'"),
    ("alice/tiny medusa", "not a valid Hub repository name"),
    ("alice/tiny--medusa", "not a valid Hub repository name"),
    ("alice/" + "x" * 97, "not a valid Hub repository name"),
    ("alice/a/b", "must be 'namespace/name'"),
])
def test_invalid_repository_name_is_refused_before_any_request(hub, export, repo_id, message):
    with pytest.raises(ValueError, match=message):
        publish_export(export, repo_id)
    with pytest.raises(ValueError, match=message):
        check_publish_ready(repo_id)
    assert hub.requests == []


def test_offline_mode_is_refused_with_the_alternative(hub, export, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PublishError, match="HF_HUB_OFFLINE is set.*dry_run=true output_dir=OUT"):
        publish_export(export, REPO)


@pytest.mark.parametrize("case", ["rejected_token", "foreign_namespace"])
def test_token_never_appears_in_errors_or_logs(hub, export, monkeypatch, caplog, capsys, case):
    secret = "hf_SecretThatMustNotLeak987"
    hub.echo_auth_in_errors = True  # a server that copies the Authorization header into its error messages
    if case == "rejected_token":
        monkeypatch.setenv("HF_TOKEN", secret)
        repo, reason = REPO, "the Hub rejected the token (401 Unauthorized)"
    else:
        hub.tokens[secret] = "alice"
        monkeypatch.setenv("HF_TOKEN", secret)
        repo, reason = "bob/tiny-medusa", "the token may not write there (403 Forbidden)"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PublishError) as info:
        publish_export(export, repo)
    shown = "".join(traceback.format_exception(info.value))
    assert reason in shown and "Already committed: nothing." in shown
    assert "(the Hub said: " in shown and "Bearer hf_***" in shown  # the echoed header, masked
    if case == "rejected_token":
        assert "log in with `hf auth login`" in shown and "HF_TOKEN" in shown
    assert info.value.__cause__ is None and info.value.__suppress_context__  # the raw error held the token
    out, err = capsys.readouterr()
    for text in (shown, caplog.text, out, err, repr(info.value.args)):
        assert secret not in text


def test_no_tree_no_eval_no_vllm_warns_and_the_card_says_so(hub, heads, base, tmp_path, caplog):
    export = write_export(tmp_path / "export", heads, base, tuned=False, evaluated=False, vllm=False)
    caplog.set_level(logging.WARNING)
    result = prepare_repo_folder(export, tmp_path / "out", REPO, license="mit")
    assert result.files == ["README.md", "config.json", "medusa_lm_head.safetensors", "token_map.safetensors"]
    assert len(result.missing) == 4
    for name in ("vllm/", "medusa_choices.json", "head_accuracy.json", "eval/summary.json"):
        assert any(name in note for note in result.missing), name
        assert name in caplog.text
    card = (tmp_path / "out" / "README.md").read_text()
    meta = readme_metadata(card)
    assert meta["license"] == "mit" and "model-index" not in meta and "vllm" not in meta["tags"]
    missing_section = card.split("## What is missing\n\n")[1].split("\n## ")[0]
    assert missing_section.count("\n- ") + missing_section.startswith("- ") == 4
    assert "No tuned tree (`medusa_choices.json`)" in missing_section
    assert "No evaluation (`eval/summary.json`)" in missing_section
    assert "### vLLM" not in card and "## Evaluation" not in card
    assert hub.count("create") == 0 and hub.count("commit") == 0


def test_base_model_override_and_unknown_license(hub, heads, base, tmp_path):
    export = tmp_path / "export"
    save_export(heads, export, str(tmp_path / "local-base"), base_model=base,
                extra_config={"medusa_train_model": {"name_or_path": str(tmp_path / "local-base")}})
    local = prepare_repo_folder(export, tmp_path / "as-is")
    meta = readme_metadata((tmp_path / "as-is" / "README.md").read_text())
    assert "base_model" not in meta and meta["license"] == "unknown" and local.license == "unknown"
    assert "a local path" in (tmp_path / "as-is" / "README.md").read_text()
    (tmp_path / "local-base").mkdir()
    (tmp_path / "local-base" / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\n---\n")
    assert prepare_repo_folder(export, tmp_path / "local-card").license == "other"
    meta = readme_metadata((tmp_path / "local-card" / "README.md").read_text())
    assert meta["license"] == "other" and meta["license_name"] == "tiny"

    prepare_repo_folder(export, tmp_path / "hub-base", base_model=BASE)
    config = json.loads((tmp_path / "hub-base" / "config.json").read_text())
    assert config["base_model_name_or_path"] == BASE and "medusa_train_model" not in config
    meta = readme_metadata((tmp_path / "hub-base" / "README.md").read_text())
    assert meta["base_model"] == BASE and meta["license"] == "apache-2.0"
    assert json.loads((export / "config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "local-base")


def test_medusa2_export_publishes_its_fine_tuned_base(heads, base, tmp_path):
    export = write_export(tmp_path / "export", heads, base, evaluated=False)
    save_base_model(base, make_tiny_tokenizer(), export)
    local = prepare_repo_folder(export, tmp_path / "repo", REPO)
    written = sorted(p.relative_to(export).as_posix() for p in (export / "base").rglob("*") if p.is_file())
    assert "base/config.json" in written and "base/model.safetensors" in written
    published = tree_of(local.folder)
    for path in written:
        assert published[path] == (export / path).read_bytes(), path
    # as medusa-train writes it: the heads' base is the folder inside the export, the original is recorded beside it
    config = json.loads((export / "config.json").read_text())
    config.update(base_model_name_or_path="base", original_base_model_name_or_path=BASE)
    (export / "config.json").write_text(json.dumps(config))
    readme = (prepare_repo_folder(export, tmp_path / "repo2", REPO).folder / "README.md").read_text()
    assert readme_metadata(readme)["base_model"] == BASE
    assert f"Medusa heads for {BASE}" in readme and "published in `base/`" in readme
    # base_model= names the model base/ was fine-tuned from; the heads keep loading base/
    config.pop("original_base_model_name_or_path")
    (export / "config.json").write_text(json.dumps(config))
    repo3 = prepare_repo_folder(export, tmp_path / "repo3", REPO, base_model=BASE).folder
    published_config = json.loads((repo3 / "config.json").read_text())
    assert published_config["base_model_name_or_path"] == "base"
    assert published_config["original_base_model_name_or_path"] == BASE
    assert readme_metadata((repo3 / "README.md").read_text())["base_model"] == BASE


def test_bad_export_and_output_folders(hub, export, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_repo_folder(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="has no summary.json"):
        prepare_repo_folder(export, tmp_path / "out", eval_dir=tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        prepare_repo_folder(export, tmp_path / "full")
    with pytest.raises(ValueError, match="inside the export folder"):
        prepare_repo_folder(export, export / "preview")


# ---------------------------------------------------------------- the command line


def compose_publish(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("publish", overrides=overrides)


def test_cli_dry_run_writes_the_folder_and_uploads_nothing(hub, export, tmp_path, capsys):
    from medusa_train.cli.publish import run

    out = tmp_path / "preview"
    result = run(compose_publish([f"export_dir={export}", f"repo_id={REPO}", "dry_run=true", f"output_dir={out}"]))
    assert result.files == sorted(HEADS_COMMIT + REST_COMMIT)
    for path in HEADS_COMMIT + REST_COMMIT[1:]:
        assert (out / path).read_bytes() == (export / path).read_bytes()
    assert f"wrote {len(result.files)} files to {out} (dry run: nothing uploaded)" in capsys.readouterr().out
    assert hub.count("create") == hub.count("commit") == 0


def test_cli_publishes_through_hf_endpoint(hub, export):
    from medusa_train.cli.publish import run

    result = run(compose_publish([f"export_dir={export}", f"repo_id={REPO}", "private=true"]))
    assert result.url == f"{hub.url}/{REPO}" and hub.repos[REPO].private is True
    assert hub.files(REPO)["config.json"] == (export / "config.json").read_bytes()


@pytest.mark.parametrize("overrides,message", [
    (["dry_run=true"], "set output_dir=OUT"),
    ([], "repo_id is required"),
    ([f"repo_id={REPO}", "output_dir=x"], "only used with dry_run=true"),
])
def test_cli_refuses_incomplete_configs(hub, export, overrides, message):
    from medusa_train.cli.publish import run

    with pytest.raises(ValueError, match=message):
        run(compose_publish([f"export_dir={export}", *overrides]))
    assert hub.requests == []


# ---------------------------------------------------------------- loading back


def test_download_export_local_folders_and_errors(hub, export, tmp_path):
    assert download_export(export) == export
    with pytest.raises(ValueError, match="local folder"):
        download_export(export, revision="v1")
    with pytest.raises(FileNotFoundError, match="no Hub repository alice/missing"):
        download_export("alice/missing", cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="neither a local export folder nor a Hub repository id"):
        download_export("./not/here")


def test_decoder_arguments_from_the_hub(hub, export, heads, base, tmp_path):
    from inference.decoders.tree import TreeDecoder

    publish_export(export, REPO)
    local_base = tmp_path / "base"
    base.save_pretrained(local_base)
    make_tiny_tokenizer().save_pretrained(local_base)
    kwargs = pretrained_decoder_kwargs(REPO, model={"name_or_path": str(local_base)}, cache_dir=tmp_path / "cache",
                                       topk=3)
    assert kwargs["medusa_choices"] == CHOICES and kwargs["topk"] == 3
    decoder = TreeDecoder(**kwargs)
    x = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(2))
    assert torch.equal(decoder.model.heads(x, base.lm_head.weight), heads(x, base.lm_head.weight))
    # Only what the decoder needs was downloaded: no vllm/, no eval/.
    snapshot = next((tmp_path / "cache").glob("models--alice--tiny-medusa/snapshots/*"))
    assert sorted(tree_of(snapshot)) == ["config.json", "medusa_choices.json", "medusa_lm_head.safetensors",
                                         "token_map.safetensors"]


# ---------------------------------------------------------------- the vLLM script (GPU only)


def test_vllm_script_needs_vllms_environment_and_uses_the_exports_heads(export, monkeypatch, tmp_path):
    from medusa_train.drafters.medusa.vllm import speculative_config
    from medusa_train.engines.vllm_env import VllmUnavailable

    spec = importlib.util.spec_from_file_location("serve_vllm", Path(__file__).parents[2] / "benchmarks" /
                                                  "serve_vllm.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert speculative_config(export) == {"method": "medusa", "model": str((export / "vllm").resolve()),
                                          "num_speculative_tokens": 3}
    monkeypatch.setenv("MEDUSA_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(VllmUnavailable, match="run `bash launch/install_vllm.sh`"):
        script.main(["--export", str(export)])


# ---------------------------------------------------------------- medusa-train push_to_hub=true


def test_training_with_push_to_hub_publishes_the_export(hub, tmp_path):
    from medusa_train.cli.train import train
    from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

    model_dir, data = write_tiny_inputs(tmp_path / "inputs", conversations=10)
    overrides = tiny_overrides(model_dir, data, tmp_path / "run", **{"trainer.max_steps": 2})
    summary = train(compose_train(overrides + ["push_to_hub=true", f"hub_repo_id={REPO}"]))
    export = Path(summary["export_dir"])
    stored = hub.files(REPO)
    assert summary["hub_url"] == f"{hub.url}/{REPO}"
    assert stored.get("medusa_lm_head.safetensors") == (export / "medusa_lm_head.safetensors").read_bytes()
    # trained on a local folder: the published config names it without its local path (nor the recorded model/)
    published, local = json.loads(stored["config.json"]), json.loads((export / "config.json").read_text())
    assert published["base_model_name_or_path"] == "tiny_llama" and str(tmp_path) not in stored["config.json"].decode()
    local.pop("medusa_train_model")
    assert published == {**local, "base_model_name_or_path": "tiny_llama"}


def test_push_to_hub_without_repo_or_token_fails_before_training(hub, tmp_path, monkeypatch):
    from medusa_train.training.recipe import build_recipe
    from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

    model_dir, data = write_tiny_inputs(tmp_path / "inputs", conversations=10)
    overrides = tiny_overrides(model_dir, data, tmp_path / "run")
    with pytest.raises(ValueError, match="hub_repo_id"):
        build_recipe(compose_train(overrides + ["push_to_hub=true"]))
    monkeypatch.delenv("HF_TOKEN")
    from medusa_train.cli.train import train

    from medusa_train.training.base_recipe import BaseRecipe

    monkeypatch.setattr(BaseRecipe, "run", lambda self: pytest.fail("trained before checking the token"))
    with pytest.raises(PublishError, match="hf auth login"):
        train(compose_train(overrides + ["push_to_hub=true", f"hub_repo_id={REPO}"]))


# ---------------------------------------------------------------- what a published repository must not hold or claim


def test_local_paths_never_reach_the_card_the_config_or_the_eval_files(heads, base, tmp_path):
    """Trained on a local llama2.c file, evaluated with absolute paths on the command line: the repository names the
    file and says it is local; with the model/ config's hub_id (or base_model=) it names the Hub id."""
    from medusa_train.config.schema import ModelConfig
    from medusa_train.loading.export import export_extra_config

    local = tmp_path / "home" / "alice" / "models"
    model_cfg = ModelConfig(name_or_path=str(local / "stories260K.bin"), format="llama2c",
                            tokenizer_path=str(local / "tok512.bin"))
    export = tmp_path / "home" / "alice" / "runs" / "export"
    save_export(heads, export, model_cfg.name_or_path, base_model=base,
                extra_config={**export_extra_config(model_cfg), "training": {"init_from": str(tmp_path / "old")}})
    (export / "eval").mkdir()
    (export / "eval" / "summary.json").write_text(json.dumps({**SUMMARY, "model": model_cfg.name_or_path}))
    (export / "eval" / "summary.md").write_text(
        f"# medusa-eval: {model_cfg.name_or_path}\n\nCommand: `medusa-eval export_dir={export} "
        f"prompts={tmp_path}/q.jsonl output_dir={export}/eval`\n\n| decoder | tokens/s |\n| --- | ---: |\n")

    def published(folder: Path) -> dict[str, str]:
        texts = {p: (folder / p).read_text() for p in ("README.md", "config.json", "eval/summary.json",
                                                       "eval/summary.md")}
        for path, text in texts.items():
            assert str(tmp_path) not in text and "/home/alice" not in text, path
        return texts

    texts = published(prepare_repo_folder(export, tmp_path / "repo", REPO, license="mit").folder)
    config = json.loads(texts["config.json"])
    assert config["base_model_name_or_path"] == "stories260K.bin" and "medusa_train_model" not in config
    assert config["training"]["init_from"] == "old"
    assert json.loads(texts["eval/summary.json"])["model"] == "stories260K.bin"
    assert "Command: `medusa-eval export_dir=export prompts=q.jsonl output_dir=eval`" in texts["eval/summary.md"]
    assert "base_model" not in readme_metadata(texts["README.md"])
    assert "The base model was a local path (`stories260K.bin`)" in texts["README.md"]
    assert "`base_model=<hub id>`" in texts["README.md"]

    # the model/ config named the Hub repository of its local copy: that is what the repository names
    record = json.loads((export / "config.json").read_text())
    record["medusa_train_model"]["hub_id"] = "karpathy/tinyllamas"
    (export / "config.json").write_text(json.dumps(record))
    texts = published(prepare_repo_folder(export, tmp_path / "repo2", REPO, license="mit").folder)
    assert json.loads(texts["config.json"])["base_model_name_or_path"] == "karpathy/tinyllamas"
    assert json.loads(texts["eval/summary.json"])["model"] == "karpathy/tinyllamas"
    assert readme_metadata(texts["README.md"])["base_model"] == "karpathy/tinyllamas"
    assert ("Trained on a local copy of the base model (`stories260K.bin`), published as `karpathy/tinyllamas`"
            in texts["README.md"])
    assert json.loads((export / "config.json").read_text())["base_model_name_or_path"] == model_cfg.name_or_path


def test_publish_refuses_non_finite_heads_before_writing_anything(heads, base, tmp_path):
    from safetensors.torch import load_file, save_file

    export = write_export(tmp_path / "export", heads, base, evaluated=False)
    state = load_file(export / "medusa_lm_head.safetensors")
    state["2.0.linear.bias"][3] = float("nan")
    save_file(state, export / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"2\.0\.linear\.bias \(head 2\): 1 NaN and 0 Inf"):
        prepare_repo_folder(export, tmp_path / "repo", REPO)
    assert not (tmp_path / "repo").exists()


def test_publish_refuses_an_export_naming_no_base_model(heads, base, tmp_path):
    export = write_export(tmp_path / "export", heads, base, evaluated=False)
    config = json.loads((export / "config.json").read_text())
    del config["base_model_name_or_path"]
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json has no base_model_name_or_path.*base_model=<Hub id>"):
        prepare_repo_folder(export, tmp_path / "repo", REPO)
    assert not (tmp_path / "repo").exists()
    config = json.loads((prepare_repo_folder(export, tmp_path / "repo", REPO, base_model=BASE, license="mit")
                         .folder / "config.json").read_text())
    assert config["base_model_name_or_path"] == BASE


def test_card_says_what_fasterdecoding_and_tgi_can_load(base, tmp_path):
    def card_of(spec: HeadsSpec, token_map=None, **save) -> tuple[str, list[str]]:
        heads = MedusaHeads(spec, token_map=token_map)
        with torch.no_grad():
            for p in heads.parameters():
                p.normal_(0, 0.3)
        export = tmp_path / f"export{len(list(tmp_path.iterdir()))}"
        save_export(heads, export, BASE, base_model=base, **save)
        out = prepare_repo_folder(export, tmp_path / f"{export.name}-repo", REPO, license="mit")
        return (out.folder / "README.md").read_text(), out.files

    card, files = card_of(HeadsSpec(3, 1, HIDDEN, VOCAB))
    assert "medusa_lm_head.pt" in files
    assert f'`MedusaModel.from_pretrained("{REPO}")` builds the base model `{BASE}`' in card
    assert f"`--model-id {REPO}` serves `{BASE}`" in card and "`--speculate 3`" in card
    card, files = card_of(HeadsSpec(3, 1, HIDDEN, VOCAB, share_lm_head=True))
    assert "each head's projection being the base lm_head" in card and "medusa_lm_head.pt" in files
    card, files = card_of(HeadsSpec(3, 2, HIDDEN, VOCAB))
    assert "medusa_lm_head.pt" not in files
    assert "**FasterDecoding** cannot load these heads: medusa_num_layers=2" in card
    assert f"`--model-id {REPO}` serves" in card  # TGI keeps the layers apart
    card, files = card_of(HeadsSpec(3, 1, HIDDEN, VOCAB, head_vocab_size=8), token_map=TOKEN_MAP)
    assert "medusa_lm_head.pt" not in files
    assert ("FasterDecoding and Text Generation Inference read no token map, so they cannot use these heads" in card)
    assert "--model-id" not in card


def test_a_stale_fasterdecoding_pt_is_refused(heads, base, tmp_path):
    spec = HeadsSpec(2, 1, HIDDEN, VOCAB)
    export = tmp_path / "export"
    first, second = MedusaHeads(spec), MedusaHeads(spec)
    with torch.no_grad():
        first.block_weight.normal_()
        second.block_weight.normal_()
    save_export(first, export, BASE, base_model=base)
    stale = (export / "medusa_lm_head.pt").read_bytes()
    save_export(second, export, BASE, base_model=base)
    (export / "medusa_lm_head.pt").write_bytes(stale)  # copied over from the older export by hand
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt holds other weights than medusa_lm_head\.safetensors"):
        prepare_repo_folder(export, tmp_path / "repo", REPO, license="mit")
