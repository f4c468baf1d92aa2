"""Publish an export: check it, write its card, assemble the repository folder, upload it (or stop at the folder).

:func:`publish_export` is what ``medusa-publish`` and ``medusa-train ... push_to_hub=true`` call (the latter from
rank 0 only, after the export is written); :func:`prepare_repo_folder` is ``dry_run=true``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from medusa_train.publish.card import hub_base, render_card
from medusa_train.publish.folder import ExportContents, collect_export, write_repo_folder
from medusa_train.publish.hub import LicenseInfo, base_model_license
from medusa_train.publish.local_paths import check_model_name
from medusa_train.publish.upload import (
    PublishError,
    check_online,
    check_repo_id,
    redacted_logs,
    resolve_token,
    upload_repo_folder,
)

log = logging.getLogger(__name__)


@dataclass
class PublishResult:
    """What a publish (or a dry run) did.

    Attributes:
        files: repository paths, sorted.
        missing: what the card says is missing (no tree, no evaluation, no ``vllm/``), also logged as warnings.
        license: the license written in the card.
        folder: the repository folder (dry run), else None.
        repo_id, revision, url, commits: the Hub repository, branch, page and commits (not for a dry run).
    """

    files: list[str]
    missing: list[str]
    license: str
    folder: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    url: str | None = None
    commits: list[str] = field(default_factory=list)


def check_base_model(base_model: str | None) -> None:
    """Raise ``ValueError`` (naming ``base_model``) unless it is None or a model name the Hub takes: it is written
    into the published config.json and the card's ``vllm serve`` / ``LLM(model=...)`` snippets."""
    if base_model is not None:
        check_model_name(base_model, "base_model", "give the Hub id of the base model (namespace/name)")


def _card(
    contents: ExportContents, repo_id: str | None, license: str | None, endpoint: str | None
) -> tuple[str, LicenseInfo | None]:
    if license:
        info: LicenseInfo | None = LicenseInfo(license, source="set when publishing")
    else:
        try:
            token = resolve_token()
        except PublishError:
            token = ""  # a public base model's card needs no token
        with redacted_logs(token):
            # the published Hub id's card, else the local base's own README.md (its path is never published)
            source = hub_base(contents) if contents.base_is_hub_id else contents.original_base
            info = base_model_license(source, endpoint, token or None)
        if info is None:
            log.warning("the base model's license is unknown: the card says `license: unknown`; pass license=... "
                        "to set it")
    return render_card(contents, repo_id, info), info


def prepare_repo_folder(
    export_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    repo_id: str | None = None,
    *,
    eval_dir: str | os.PathLike[str] | None = None,
    license: str | None = None,
    base_model: str | None = None,
    endpoint: str | None = None,
    link: bool = False,
) -> PublishResult:
    """Write the repository folder of ``export_dir`` (files copied, card rendered) into ``output_dir``.

    Args:
        export_dir: the export folder (checked strictly first).
        output_dir: an empty or absent folder, outside the export.
        repo_id: the repository the card names (a placeholder when None).
        eval_dir: the evaluation folder (default ``export_dir/eval``).
        license: the license to declare (default: the base model's, looked up; ``unknown`` when not found).
        base_model: Hub id to publish as the base model (see :func:`~medusa_train.publish.folder.collect_export`).
        endpoint: the Hub used for the license lookup.
        link: hard-link instead of copying (for a private staging folder).

    Raises:
        FileNotFoundError, ValueError: see :func:`~medusa_train.publish.folder.collect_export` and
            :func:`~medusa_train.publish.folder.write_repo_folder`; ValueError for an invalid ``repo_id`` or
            ``base_model`` (the field named, before anything is read or written).
    """
    if repo_id is not None:
        check_repo_id(repo_id)
    check_base_model(base_model)
    contents = collect_export(export_dir, eval_dir, base_model)
    card, info = _card(contents, repo_id, license, endpoint)
    files = write_repo_folder(contents, card, output_dir, link=link)
    return PublishResult(files, list(contents.missing), info.license if info else "unknown", Path(output_dir),
                         repo_id)


def publish_export(
    export_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    eval_dir: str | os.PathLike[str] | None = None,
    license: str | None = None,
    base_model: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> PublishResult:
    """Publish ``export_dir`` to the Hub repository ``repo_id`` (created if needed), card included.

    Checks the name, offline mode and the token, then the export, before any request; assembles the folder in a
    temporary staging folder beside the export (hard links, so large weights are not copied) and uploads it in two
    commits (:mod:`medusa_train.publish.upload`). Call it from one process only (rank 0 under torchrun).

    Args:
        export_dir: the export folder.
        repo_id: ``namespace/name``.
        private: create the repository private (an existing repository keeps its visibility).
        revision: the branch (default ``main``; created when missing).
        eval_dir, license, base_model: see :func:`prepare_repo_folder`.
        commit_message: first line of the commits.
        endpoint: the Hub (default ``$HF_ENDPOINT`` or huggingface.co).

    Returns:
        :class:`PublishResult` with the URL and commits.

    Raises:
        ValueError: invalid ``repo_id``, ``base_model`` or export. FileNotFoundError: no export there.
        PublishError: no token (the message says how to log in), offline mode, or a Hub / network failure (the
            message lists what was committed; re-running resumes).
    """
    check_repo_id(repo_id)
    check_base_model(base_model)
    check_online()
    token = resolve_token()
    staging_parent = Path(export_dir).resolve().parent
    if not os.access(staging_parent, os.W_OK):
        staging_parent = Path(tempfile.gettempdir())
    staging = Path(tempfile.mkdtemp(prefix=".medusa-publish-", dir=staging_parent))
    try:
        with redacted_logs(token):
            prepared = prepare_repo_folder(export_dir, staging / "repo", repo_id, eval_dir=eval_dir, license=license,
                                           base_model=base_model, endpoint=endpoint, link=True)
            uploaded = upload_repo_folder(staging / "repo", repo_id, private=private, revision=revision,
                                          commit_message=commit_message, endpoint=endpoint)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("published %s to %s", export_dir, uploaded.url)
    return PublishResult(prepared.files, prepared.missing, prepared.license, None, repo_id, uploaded.revision,
                         uploaded.url, uploaded.commits)
