"""Every drafter's training loss through the chunked projection (``trainer.loss_chunk_size``) against the logits
held at once (``loss_chunk_size=0``): the same loss, gradients and metrics on the recipe's own batches, and the same
short training run (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from medusa_train.training import chunked_loss
from medusa_train.training.joint import causal_lm
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_eagle3_training import EAGLE3
from tests.medusa_train.test_medusa2 import joint_overrides
from tests.medusa_train.test_training import compose_train, tiny_inputs, tiny_overrides

__all__ = ["tiny_inputs"]  # the module's fixture

pytestmark = pytest.mark.usefixtures("one_thread")

# drafter -> (overrides, joint): soft and greedy targets, per-head and shared projections, a reduced vocabulary
DRAFTERS = {
    "medusa_soft": (["heads.num_heads=3", "heads.target=soft"], False),
    "medusa_shared_map": (["heads.share_lm_head=true", "heads.head_vocab_size=64", "heads.target=base_argmax"],
                          False),
    "hydra": (["heads=hydra", "heads.num_heads=2", "heads.target=soft"], False),
    "eagle3": ([*EAGLE3, "heads.target=base_argmax"], False),
    "medusa2_lora": (["heads.target=soft"], True),
    # the base's own LM / KL loss and argmax projected in chunks too (soft targets keep the base's logits whole)
    "medusa2_lora_argmax": (["heads.target=base_argmax"], True),
    "medusa2_lora_kl": (["heads.target=base_argmax", "heads.base_loss=kl"], True),
    "medusa2_full": (["heads.target=labels", "heads.finetune=full"], True),
}


def overrides_for(name: str, model_dir, data, run, chunk: int, **extra) -> list[str]:
    drafter, joint = DRAFTERS[name]
    settings = {"trainer.loss_chunk_size": chunk, **extra}
    base = (joint_overrides if joint else tiny_overrides)(model_dir, data, run, **settings)
    return [*base, *drafter]


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_chunked_loss_equals_the_logits_held_at_once_on_the_recipes_batches(name, tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(overrides_for(name, model_dir, data, tmp_path / "run", 0)))
    recipe.setup()
    try:
        trainer = recipe.trainer
        model = trainer.model
        model.train()
        whole = trainer.loss_spec
        assert whole.loss_chunk_size == 0
        chunked = dataclasses.replace(whole, loss_chunk_size=7)
        for i, batch in enumerate(trainer.get_train_dataloader()):
            if i == 2:
                break
            results = []
            for spec in (whole, chunked):
                trainer.loss_spec = spec
                trainer.head_metrics["train"].reset()
                model.zero_grad(set_to_none=True)
                loss = trainer.compute_loss(model, batch)
                loss.backward()
                results.append((loss.item(), trainer.head_metrics["train"].sums.clone(),
                                {n: p.grad.clone() for n, p in trainable(model) if p.grad is not None}))
            (loss0, sums0, grads0), (loss1, sums1, grads1) = results
            assert loss1 == pytest.approx(loss0, rel=1e-5)
            assert torch.equal(sums0[1:], sums1[1:])  # top-1, top-5 hits and counts
            assert torch.allclose(sums0[0], sums1[0], rtol=1e-5)  # per-head loss sums
            assert sorted(grads0) == sorted(grads1) and grads0
            for n in grads0:
                assert torch.allclose(grads0[n], grads1[n], rtol=1e-4, atol=1e-6), n
    finally:
        recipe.cleanup()


def test_the_joint_base_never_holds_its_logits_whole(tiny_inputs, tmp_path):
    # Medusa-2's base loss and argmax project through the lm_head's weight in chunks: the lm_head module, whose
    # output is the [B, T, V] logits, never runs; the largest logits block is a chunk's
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(overrides_for("medusa2_lora_kl", model_dir, data, tmp_path / "run", 3)))
    recipe.setup()
    try:
        trainer, model = recipe.trainer, recipe.trainer.model
        model.train()
        calls: list[tuple[int, ...]] = []
        lm_head = causal_lm(model.base).get_output_embeddings()
        handle = lm_head.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
        projected: list[int] = []
        real = chunked_loss._chunk_logits

        def spy(features, weight, start, end):
            projected.append(end - start)
            return real(features, weight, start, end)

        batch = next(iter(trainer.get_train_dataloader()))
        try:
            chunked_loss._chunk_logits = spy
            trainer.compute_loss(model, batch).backward()
        finally:
            chunked_loss._chunk_logits = real
            handle.remove()
        assert calls == []
        assert projected and max(projected) == 3 < batch["input_ids"].numel()
    finally:
        recipe.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_short_training_run_gives_the_same_loss_chunked_or_not(name, tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    results = {}
    for chunk in (0, 5):
        run = tmp_path / f"chunk{chunk}"
        summary = build_recipe(compose_train(overrides_for(name, model_dir, data, run, chunk,
                                                           **{"trainer.max_steps": 4}))).run()
        results[chunk] = summary["train_loss"]
    # the loss only: Adam turns rounding-level gradient differences on near-zero gradients into weight differences
    # above assert_same_heads' tolerance (seen for hydra and medusa_soft after 4 steps at lr 1e-2)
    assert results[5] == pytest.approx(results[0], rel=1e-5)


def test_loss_chunk_size_zero_is_off_and_a_negative_one_is_refused_naming_the_field():
    from medusa_train.config.schema import TrainerConfig

    TrainerConfig(loss_chunk_size=0).validate()
    with pytest.raises(ValueError, match=r"trainer\.loss_chunk_size.*0: off"):
        TrainerConfig(loss_chunk_size=-1).validate()
