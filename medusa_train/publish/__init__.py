"""Publish exports to the Hugging Face Hub and load them back.

- :func:`publish_export`: export folder -> Hub repository (model card, heads, ``vllm/``, tree, evaluation).
- :func:`prepare_repo_folder`: the same repository folder written locally (``medusa-publish dry_run=true``).
- :func:`check_publish_ready`: repository name, offline mode and token, without a request (before training).

Reading an export back from the Hub is not here: :func:`medusa_train.loading.hub.download_export` (Hub id or
folder -> local folder) and :func:`inference.decoders.pretrained.pretrained_decoder_kwargs`
(``TreeDecoder.from_pretrained``).
"""

from __future__ import annotations

from medusa_train.publish.pipeline import PublishResult, prepare_repo_folder, publish_export
from medusa_train.publish.upload import PublishError, check_publish_ready

__all__ = ["PublishError", "PublishResult", "check_publish_ready", "prepare_repo_folder", "publish_export"]
