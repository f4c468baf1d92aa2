"""The frozen-base recipe (``heads.mode=frozen_base``, every drafter type; Medusa-1's): a new drafter trained on a
frozen base.

setup: checks and the folder's lock, process group, base model and data (:class:`BaseRecipe`); heads built from the
base lm_head (with a token map of the most frequent training tokens when ``heads.head_vocab_size`` is set); with
``hidden_cache=true`` the base runs once per sequence into a cache and the backbone is dropped; then the folder is
prepared and the HF Trainer built on the heads alone (:class:`~medusa_train.training.trainer.DrafterTrainer`, which
stops on a non-finite loss or weight and on a diverged head). train: :meth:`BaseRecipe.train`. save: the gathered
heads are measured against the frozen base and exported.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from medusa_train.data import Collator
from medusa_train.models.catalog import drafter_type, type_of
from medusa_train.training.base_placement import ZERO3, partition_numel, release_backbone, stop_zero3_engine
from medusa_train.training.base_recipe import BaseRecipe
from medusa_train.training.data_prep import PreparedData
from medusa_train.training.hidden_cache import (
    CachedHiddenDataset,
    HiddenCollator,
    base_weights_digest,
    build_hidden_cache,
    dataset_fingerprint,
)
from medusa_train.training.step import FrozenBase
from medusa_train.training.trainer import DrafterTrainer

log = logging.getLogger(__name__)


class FrozenBaseRecipe(BaseRecipe):
    """One frozen-base run (see the module docstring); arguments as :class:`BaseRecipe`."""

    def check(self) -> dict[str, Any] | None:
        """:meth:`BaseRecipe.check`; warns when the heads' type has no vLLM layout (Hydra heads)."""
        ds_config = super().check()
        cfg = self.cfg
        problem = drafter_type(cfg.heads.head_type).engine_problem("vllm")
        if cfg.export and cfg.export_vllm and problem is not None and self.env.is_main:
            log.warning("export_vllm=true is skipped for %s heads: %s (set export_vllm=false to silence this)",
                        drafter_type(cfg.heads.head_type).title, problem)
        return ds_config

    # ---- setup -----------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Checks and lock, process group, base model, data, heads, optional hidden cache, then the folder is
        prepared and the Trainer built."""
        args = self.start()
        data = self.load_base_and_data(args)
        heads = self.new_heads(data)
        self.loss_spec = self.loss_spec_for(heads)
        self.frozen_base = FrozenBase.of(self.base)
        self.collator: Any = Collator.from_tokenizer(self.tokenizer)
        train_set, eval_set = data.train, data.eval
        if self.cfg.hidden_cache:
            train_set, eval_set = self.cached_datasets(data, args.per_device_eval_batch_size, heads)
        self.eval_set = eval_set
        self.prepare_folder(heads)
        self.trainer = DrafterTrainer(model=heads, frozen_base=self.frozen_base,
                                     **self.trainer_kwargs(args, train_set, eval_set))

    def cached_datasets(self, data: PreparedData, batch_size: int, heads: Any) -> tuple[Any, Any]:
        """Build this rank's cache shards (each sealed one reused checked against its sha256 first: one changed in
        place is rebuilt with a warning), wait for all ranks, and read every shard back; drop the backbone."""
        folder = Path(self.cfg.hidden_cache_dir or self.paths.hidden_cache)
        dtype = self.base.get_output_embeddings().weight.dtype
        out = []
        fingerprints = {}
        features = type_of(heads).feature_names(heads.spec)  # what the heads read of the base
        base_digest = base_weights_digest(self.base)
        for split, dataset in (("train", data.train), ("eval", data.eval)):
            fingerprints[split] = dataset_fingerprint(dataset, base_digest, dtype)
            build_hidden_cache(self.frozen_base, dataset, folder, split=split, fingerprint=fingerprints[split],
                               collator=self.collator, batch_size=batch_size, rank=self.env.rank,
                               world_size=self.env.world_size, device=self.device, features=features,
                               verify=True, lockstep=self.placement == ZERO3,
                               argmax_chunk_size=self.cfg.trainer.loss_chunk_size)
        self.barrier()
        for split, dataset in (("train", data.train), ("eval", data.eval)):
            out.append(CachedHiddenDataset(dataset, folder, split=split, fingerprint=fingerprints[split],
                                           features=features))
        self.release_base()
        self.frozen_base = FrozenBase.of(self.base, keep_backbone=False)
        self.collator = HiddenCollator()
        return out[0], out[1]

    def release_base(self) -> None:
        """Once the cache is built: keep of the base only what the heads read (lm_head and input embeddings, whole on
        every rank), drop its backbone (:func:`~medusa_train.training.base_placement.release_backbone`) and, under
        ZeRO-3, its engine; logs the parameters this rank still holds of it."""
        stop_zero3_engine(self.base_engine)
        self.base_engine = None
        release_backbone(self.base)
        held, _ = partition_numel(self.base)
        log.info("hidden cache built: the base's backbone is released; rank %d keeps %d of its parameters (lm_head "
                 "and input embeddings)", self.env.rank, held)
        self.summary["base_kept_after_cache"] = held

    # ---- save ------------------------------------------------------------------------------------------------------

    def save_export(self, state: dict[str, torch.Tensor]) -> Path | None:
        """Main process: the trained heads' accuracy table on the frozen base, then ``export/`` (``export=true``)."""
        heads = self.trained_heads(state)
        table = self.accuracy_table(heads, self.frozen_base)
        if not self.cfg.export:
            return None
        model_cfg = self.cfg.model
        return self.write_export(heads.cpu(), table, base_name=model_cfg.name_or_path, model_cfg=model_cfg,
                                 base_model=self.base)
