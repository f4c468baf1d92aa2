from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.tune_tree import register_schemas
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from tests.conftest import make_tiny_model, make_tiny_tokenizer

register_schemas()  # what conf/tune_tree.yaml composes from


@pytest.fixture
def tiny_export(tmp_path):
    base = make_tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    heads = new_heads_for(base, num_heads=3)
    model_cfg = ModelConfig(name_or_path=str(tmp_path / "base"))
    save_export(heads, tmp_path / "export", str(tmp_path / "base"), extra_config=export_extra_config(model_cfg))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["hello there", "tell me a story", "abc"])) + "\n")
    return tmp_path / "export", prompts


def test_tune_tree_writes_a_valid_tree_for_the_export(tiny_export):
    from inference.cli.tune_tree import run
    from inference.tuning.replay import replayed_accept_length
    from inference.tuning.search import expected_accept_length, greedy_tree
    from inference.tuning.timed import choose, fastest

    export, prompts = tiny_export
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("tune_tree", overrides=[f"export_dir={export}", "prompts.source=jsonl",
                                              f"prompts.path={prompts}", "max_new_tokens=12", "topk=4",
                                              "latency_sizes=[1,4,8]", "context_length=16", "repeats=1",
                                              "max_nodes=7", "timed_new_tokens=10", "dtype=float32"])
    result = run(cfg)
    choices = json.loads((export / "medusa_choices.json").read_text())
    acc = json.loads((export / "head_accuracy.json").read_text())
    latency = json.loads((export / "latency_profile.json").read_text())
    assert choices == result["medusa_choices"] and 1 <= len(choices) <= 7
    assert len(acc["acc"]) == 3 and len(acc["acc"][0]) == 4
    # every prompt was continued and scored
    assert acc["prompts"] == 3 and sum(acc["positions"]) > 0
    assert set(latency["latency_ms"]) == {"1", "4", "8"}
    # the chosen tree is a prefix of the greedy order, so it is the best tree of its size for the measured table
    assert choices == greedy_tree(acc["acc"], len(choices))
    assert result["expected_accept_length"] == pytest.approx(expected_accept_length(acc["acc"], choices))
    # one decoding state per continuation token but the first (the prefill's), each with a rank per head
    states = acc["target_ranks"]
    assert sum(len(s) for s in states) == acc["new_tokens"] - acc["prompts"]
    assert all(len(ranks) == 3 and all(-1 <= r < 4 for r in ranks) for s in states for ranks in s)
    assert result["replayed_accept_length"] == pytest.approx(replayed_accept_length(states, choices))
    assert latency["predicted"][str(len(choices) + 1)]["replayed_tokens"] == result["replayed_accept_length"]
    # the size was chosen by decoding the 3 prompts with the shortlisted trees: the fastest measured is kept when
    # it beats the predicted best beyond the noise, else the predicted best (timed.choose on the recorded table)
    chosen = latency["chosen"]
    timed = {int(n): row for n, row in chosen["timed"].items()}
    assert chosen["by"] == "timed" and chosen["nodes"] == len(choices) and chosen["timed_prompts"] == 3  # all 3
    assert chosen["predicted_nodes"] + 1 in timed and len(choices) + 1 in timed
    kept, margin = choose(timed, chosen["predicted_nodes"] + 1)
    assert len(choices) + 1 == kept and chosen["margin"] == margin
    assert kept in (chosen["predicted_nodes"] + 1, fastest(timed))
    for row in timed.values():  # no EOS: 3 prompts x 9 tokens after the prefill's, for every tree
        assert row["tokens"] == 3 * 9 and 1.0 <= row["mean_accepted_tokens"] <= 4.0
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])


def test_the_tree_decoded_fastest_is_kept_over_the_predicted_best(tiny_export, monkeypatch):
    from inference.cli.tune_tree import run
    from inference.tuning.search import greedy_tree

    export, prompts = tiny_export
    seen = {}

    def timed_by_hand(model, token_prompts, trees, max_new_tokens):
        seen.update(trees=trees, prompts=len(token_prompts), tokens=max_new_tokens)
        ranked = sorted(trees, reverse=seen["fastest"] == "smallest")  # the last decodes fastest, whatever predicted
        # every prompt at the same speed: any difference is beyond the noise
        return {n: {"tokens_per_s": float(i + 1), "mean_accepted_tokens": 1.0, "step_ms": 1.0, "tokens": 1,
                    "seconds": 1.0, "prompt_tokens": [10, 10], "prompt_seconds": [10 / (i + 1)] * 2}
                for i, n in enumerate(ranked)}

    # which sizes are timed is shortlist's (test_tree_search.py); here: 2, 4 and 8 tokens, whatever the profile
    monkeypatch.setattr("inference.tuning.tune.shortlist", lambda rates, sizes: [2, 4, 8])
    monkeypatch.setattr("inference.tuning.tune.time_trees", timed_by_hand)
    seen["fastest"] = "largest"
    overrides = [f"export_dir={export}", "prompts.source=jsonl", f"prompts.path={prompts}", "max_new_tokens=12",
                 "topk=4", "latency_sizes=[1,2,4,8]", "context_length=16", "repeats=1", "max_nodes=7",
                 "dtype=float32", "timed_prompts=2", "timed_new_tokens=20"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        result = run(compose("tune_tree", overrides=overrides))
        off = compose("tune_tree", overrides=[*overrides[:-2], "timed_prompts=0"])
        negative = compose("tune_tree", overrides=[*overrides[:-2], "timed_prompts=-1"])
    acc = result["head_accuracy"]["acc"]
    predicted_size = result["chosen"]["predicted_nodes"] + 1  # timed too: the timing is measured against it
    assert seen["prompts"] == 2 and seen["tokens"] == 20 and sorted(seen["trees"]) == sorted({2, 4, 8, predicted_size})
    assert all(tree == greedy_tree(acc, n - 1) for n, tree in seen["trees"].items())  # each the best of its size
    assert result["medusa_choices"] == greedy_tree(acc, 7) and result["chosen"]["by"] == "timed"
    assert result["chosen"]["nodes"] == 7 and result["chosen"]["timed"]["8"]["tokens_per_s"] == len(seen["trees"])
    if predicted_size != 8:  # the fastest beat the prediction on every prompt: beyond the noise
        assert result["chosen"]["margin"]["separated"] and result["chosen"]["margin"]["low"] > 1
    seen["fastest"] = "smallest"  # the other end: the choice follows the timing, not the profile
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        assert run(compose("tune_tree", overrides=overrides))["medusa_choices"] == greedy_tree(acc, 1)
    with pytest.raises(ValueError, match=r"timed_prompts must be >= 0 .* got -1"):
        run(negative)
    predicted = run(off)  # 0: the predicted best, nothing decoded
    assert predicted["chosen"] == {"predicted_nodes": len(predicted["medusa_choices"]),
                                   "nodes": len(predicted["medusa_choices"]), "by": "predicted"}


def test_tune_tree_rejects_bad_budget_before_loading(tiny_export):
    from inference.cli.tune_tree import run

    export, prompts = tiny_export
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("tune_tree", overrides=[f"export_dir={export}", "max_nodes=0"])
        no_batch = compose("tune_tree", overrides=[f"export_dir={export}", "generation_batch_size=0"])
    with pytest.raises(ValueError, match="node budget"):
        run(cfg)
    with pytest.raises(ValueError, match="generation_batch_size must be >= 1"):
        run(no_batch)


def test_a_second_export_of_the_base_is_tuned_against_the_first_ones_latency_profile(tiny_export, tmp_path,
                                                                                     monkeypatch):
    """``latency_from``: one profile for several exports of one base (no new measurement, the same numbers), refused
    when missing or measured on another dtype or other linear kernels."""
    from inference.cli.tune_tree import run

    export, prompts = tiny_export
    common = ["prompts.source=jsonl", f"prompts.path={prompts}", "max_new_tokens=12", "topk=4",
              "latency_sizes=[1,4,8]", "context_length=16", "repeats=1", "max_nodes=7", "dtype=float32"]
    second = tmp_path / "second"
    base = make_tiny_model("llama")
    save_export(new_heads_for(base, num_heads=3, head_type="hydra"), second, str(tmp_path / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        with pytest.raises(FileNotFoundError, match="latency_profile.json not found; tune that export first"):
            compose_and_validate(["export_dir=" + str(second), f"latency_from={export}", *common])
        run(compose("tune_tree", overrides=[f"export_dir={export}", *common]))
        run(compose("tune_tree", overrides=[f"export_dir={second}", f"latency_from={export}", *common]))
        first = json.loads((export / "latency_profile.json").read_text())
        reused = json.loads((second / "latency_profile.json").read_text())
        assert reused["latency_ms"] == first["latency_ms"] and reused["measured_for"] == str(export)
        with pytest.raises(ValueError, match="measured on cpu in float32, but these heads decode on cpu in bfloat16"):
            run(compose("tune_tree", overrides=[f"export_dir={second}", f"latency_from={export}", *common,
                                                "dtype=bfloat16"]))
        def no_measuring(*args, **kwargs):
            raise AssertionError("head accuracy measured before the profile was checked")

        monkeypatch.setattr("inference.tuning.tune.measure_head_accuracy", no_measuring)  # the check comes first
        with pytest.raises(ValueError, match="measured on onednn_packed linear kernels, but these heads decode on "
                                             "pytorch"):
            run(compose("tune_tree", overrides=[f"export_dir={second}", f"latency_from={export}", *common,
                                                "cpu_kernels=none"]))


def compose_and_validate(overrides):
    from medusa_train.config.schema import as_dataclass
    from inference.tuning.tune_tree_config import TuneTreeConfig

    return as_dataclass(TuneTreeConfig, compose("tune_tree", overrides=overrides))


def test_the_prediction_is_kept_unless_the_fastest_timed_beats_it_beyond_the_noise():
    from inference.tuning.timed import choose

    def row(seconds):
        return {"tokens_per_s": 40 / sum(seconds), "prompt_tokens": [10] * 4, "prompt_seconds": seconds}

    predicted = row([1.0, 1.0, 1.0, 1.0])  # 10 tokens/s on every prompt
    noisy = row([0.5, 1.5, 0.6, 1.2])  # 10.5 tokens/s overall, slower on two prompts of four
    steady = row([0.9, 0.9, 0.9, 0.9])  # 11.1 tokens/s on every prompt
    kept, margin = choose({4: predicted, 8: noisy}, predicted=4)
    assert kept == 4 and margin["estimate"] == pytest.approx(4.0 / 3.8) and not margin["separated"]
    kept, margin = choose({4: predicted, 8: steady}, predicted=4)
    assert kept == 8 and margin["low"] == pytest.approx(1 / 0.9) and margin["separated"]
    assert choose({4: predicted, 8: row([2.0] * 4)}, predicted=4) == (4, None)  # the prediction is the fastest
    with pytest.raises(ValueError, match="the predicted best size 6 was not timed"):
        choose({4: predicted}, predicted=6)


def test_a_folder_that_is_not_an_export_is_refused_before_anything_is_written_into_it(tmp_path):
    import subprocess
    import sys

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    run = subprocess.run([sys.executable, "-m", "inference.cli.tune_tree", f"export_dir={mine}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert (f"medusa-tune-tree: export_dir {mine} holds no config.json: it is not an export written by medusa-train"
            in run.stderr)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # no .tune_tree/ log, no lock
    missing = tmp_path / "missing"
    run = subprocess.run([sys.executable, "-m", "inference.cli.tune_tree", f"export_dir={missing}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and f"export_dir {missing} is no such folder" in run.stderr and not missing.exists()


def hydra_callbacks(config_name: str, overrides: list[str]):
    """The composed config (Hydra's node included) and its ``hydra.callbacks``, instantiated as Hydra does."""
    from hydra.utils import instantiate

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    return cfg, [instantiate(c) for c in cfg.hydra.callbacks.values()]


@pytest.mark.parametrize("override, message", [
    ("topk=0", "topk must be >= 1, got 0"),
    ("latency_sizes=[4]", "latency_sizes must hold at least two sizes >= 1, got [4]"),
    ("dtype=float33", "dtype must be one of auto, float32, fp32, bfloat16, bf16, float16, fp16, got 'float33'"),
    ("prompts.source=jsonl", "prompts.source=jsonl needs prompts.path"),
    ("prompts.path=PROMPTS/missing.jsonl", "prompt file PROMPTS/missing.jsonl not found"),
    ("prompts.source=mt_bnech", "unknown prompt source 'mt_bnech'"),
    ("latency_from=PROMPTS/nowhere", "latency_from=PROMPTS/nowhere: PROMPTS/nowhere/latency_profile.json not found"),
])
def test_bad_settings_are_refused_before_hydra_makes_its_log_folder_in_the_export(tiny_export, capsys, override,
                                                                                   message):
    """Hydra's run folder is ``export/.tune_tree`` (its log, tune_tree.log): the callback checks every setting
    (TuneTreeConfig.validate) before Hydra creates it, in one line with exit status 2."""
    export, prompts = tiny_export
    override, message = (text.replace("PROMPTS", str(prompts.parent)) for text in (override, message))
    cfg, callbacks = hydra_callbacks("tune_tree", [f"export_dir={export}", override])
    assert cfg.hydra.run.dir == f"{export}/.tune_tree"
    with pytest.raises(SystemExit) as exit_:
        for callback in callbacks:
            callback.on_run_start(cfg)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("medusa-tune-tree: ") and err.count("\n") == 1, err
    assert message in err
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "medusa_lm_head.pt",
                                                        "medusa_lm_head.safetensors", "vllm"]  # no .tune_tree/


@pytest.mark.slow  # a process: about 30 s on 2 shared cores
def test_the_command_refuses_a_bad_setting_without_writing_into_the_export(tiny_export):
    import subprocess
    import sys

    export, _ = tiny_export
    run = subprocess.run([sys.executable, "-m", "inference.cli.tune_tree", f"export_dir={export}", "max_nodes=0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr == "medusa-tune-tree: max_nodes must be >= 1 (the tree node budget), got 0\n"
    assert not (export / ".tune_tree").exists()
