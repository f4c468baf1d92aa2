"""Tree decoding on a real model (stories260K) with Medusa and Hydra heads trained by medusa-train: identical to plain
greedy decoding, the trained heads make it accept more than one token per forward pass, and the tree tuner's replay
predicts the decoder's counts."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from inference.decoders import DecodeConfig, TreeDecoder, VanillaDecoder
from inference.tuning.accuracy import measure_head_accuracy
from inference.tuning.replay import replay_counts
from medusa_train.cli.train import register_schemas
from medusa_train.loading.export import load_export
from medusa_train.files.paths import CONF_DIR
from medusa_train.training.recipe import build_recipe
from medusa_train.tree.buffers import chain_choices

register_schemas()  # what conf/train.yaml composes from

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The cat was sad.", "Tom had a big red ball."]


@pytest.mark.slow
def test_trained_stories260k_heads_decode_exactly_greedy_and_accept_more(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path / 'run'}", "trainer.max_steps=60", "export_vllm=false",
                                          "trainer.disable_tqdm=true"])
    summary = build_recipe(cfg).run()
    model, tokenizer, _ = load_export(summary["export_dir"])
    vanilla = VanillaDecoder(model.base)
    tree = chain_choices(model.heads.spec.num_heads) + [[1], [0, 1]]
    medusa = TreeDecoder(model, tree, topk=4)
    config = DecodeConfig(max_new_tokens=64)
    passes = tokens = 0
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        reference = vanilla.generate(ids, config)
        result = medusa.generate(ids, config)
        assert result.tokens == reference.tokens, text
        passes += result.forward_passes
        tokens += sum(result.accepted_lengths)
    assert tokens / passes > 1.3  # measured 1.67 with 60 training steps
    # the tree tuner's replay of greedy verification predicts these counts from the teacher-forced head ranks
    recorded = measure_head_accuracy(model, [tokenizer(text)["input_ids"] for text in PROMPTS], max_new_tokens=64,
                                     topk=4, eos_token_id=None)
    predicted_tokens, predicted_passes = replay_counts(recorded["target_ranks"], tree)
    assert predicted_tokens == tokens
    assert abs(predicted_passes - passes) <= 1  # a floating-point tie between cached and teacher-forced logits at most
    # continuing the prompts in one left-padded batch measures the same continuations
    batched = measure_head_accuracy(model, [tokenizer(text)["input_ids"] for text in PROMPTS], max_new_tokens=64,
                                    topk=4, eos_token_id=None, batch_size=len(PROMPTS))
    assert batched["target_ranks"] == recorded["target_ranks"]


@pytest.mark.slow
def test_trained_stories260k_hydra_heads_decode_exactly_greedy_and_the_replay_gives_the_decoders_counts(tmp_path):
    """Hydra heads' accuracy depends on the path they are given; on the path greedy verification accepts (the base's
    own tokens) that is the teacher-forced rank the tuner records, so its replay is the decoder's count."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path / 'run'}", "heads=hydra", "trainer.max_steps=60",
                                          "export_vllm=false", "trainer.disable_tqdm=true"])
    summary = build_recipe(cfg).run()
    model, tokenizer, config = load_export(summary["export_dir"], head_type="hydra")
    assert config["head_type"] == "hydra"
    vanilla = VanillaDecoder(model.base)
    tree = chain_choices(model.heads.spec.num_heads) + [[1], [0, 1], [1, 0], [0, 0, 1]]
    hydra = TreeDecoder(model, tree, topk=4)
    config = DecodeConfig(max_new_tokens=64)
    passes = tokens = 0
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        result = hydra.generate(ids, config)
        assert result.tokens == vanilla.generate(ids, config).tokens, text
        assert result.draft_time_s > 0 and result.verify_time_s > 0
        passes += result.forward_passes
        tokens += sum(result.accepted_lengths)
    assert tokens / passes > 1.5
    recorded = measure_head_accuracy(model, [tokenizer(text)["input_ids"] for text in PROMPTS], max_new_tokens=64,
                                     topk=4, eos_token_id=None)
    assert replay_counts(recorded["target_ranks"], tree) == (tokens, passes)
