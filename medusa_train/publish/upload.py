"""Upload a repository folder to the Hub: token, repository name, ``create_repo``, ``upload_folder`` in two commits.

The folder goes up in two commits, each atomic on the Hub:

1. the heads: ``config.json``, the weights, the token map and ``vllm/`` (after it the repository already loads);
2. the rest: tree, accuracy table, evaluation and ``README.md`` (the card lands last).

A failure names what was committed and what was not. Re-running resumes: ``huggingface_hub`` asks the Hub for the
hash of every file already at each path (the ``preupload`` answer) and skips files that did not change, so the
committed part is not sent again and no empty commit is made; large files already in Hub storage are deduplicated
(Xet) as well.

The token comes from ``HF_TOKEN`` or the login saved by ``hf auth login``; it is never printed, logged or put in
an exception message (:func:`redact`; log records are filtered while uploading).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from medusa_train.version import __version__
from medusa_train.loading.hub import hub_endpoint

log = logging.getLogger(__name__)

MASK = "hf_***"
LOGIN_HINT = ("log in with `hf auth login` (`huggingface-cli login` in huggingface_hub < 1.0) or set the HF_TOKEN "
              "environment variable to a token with write access (https://huggingface.co/settings/tokens)")
RESUME_HINT = ("Re-run the same command to resume: the Hub reports the hash of every file it already has, unchanged "
               "files are skipped, and only the rest is sent.")
# (commit label, patterns of the repository paths it holds); the last group takes every remaining file.
COMMIT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("heads", ("config.json", "medusa_lm_head.*", "token_map.safetensors", "vllm/*")),
    ("tree, evaluation and model card", ("*",)),
)


class PublishError(RuntimeError):
    """Publishing failed at the Hub (token, permissions, network). The message never holds the token.

    Attributes:
        committed: repository paths committed before the failure.
        pending: repository paths not committed.
    """

    def __init__(self, message: str, committed: list[str] | None = None, pending: list[str] | None = None) -> None:
        super().__init__(message)
        self.committed = list(committed or [])
        self.pending = list(pending or [])


@dataclass
class UploadResult:
    """What :func:`upload_repo_folder` did.

    Attributes:
        repo_id: the repository.
        revision: the branch written.
        url: the repository's page.
        commits: the head commit after each group, without repeats (a group found unchanged on the Hub makes
            no commit: re-running a finished upload adds nothing).
        files: every repository path uploaded or found unchanged.
    """

    repo_id: str
    revision: str
    url: str
    commits: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` replaced by :data:`MASK`."""
    return text.replace(secret, MASK) if secret else text


def check_repo_id(repo_id: str) -> None:
    """Check the name locally, before any request.

    Raises:
        ValueError: not ``namespace/name`` with letters, digits, ``-``, ``_``, ``.`` (at most 96 characters each,
            no ``--`` or ``..``, not ending in ``.git``), huggingface_hub's rules.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"repo_id must be 'namespace/name' (your user or organisation, then the repository), "
                         f"got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"repo_id {repo_id!r} is not a valid Hub repository name: {e}") from e


def resolve_token() -> str:
    """The Hub token of this user: ``HF_TOKEN``, else the saved login.

    Raises:
        PublishError: none is set; the message says how to log in.
    """
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PublishError(f"no Hugging Face token found: {LOGIN_HINT}")
    return token


def check_online() -> None:
    """Raise :class:`PublishError` when ``HF_HUB_OFFLINE`` forbids requests."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise PublishError("HF_HUB_OFFLINE is set: publishing needs the Hub. Unset HF_HUB_OFFLINE, or preview the "
                           "repository folder with dry_run=true output_dir=OUT")


def check_publish_ready(repo_id: str) -> None:
    """Everything that can be checked without a request: the name, offline mode, a token (call before training).

    Raises:
        ValueError: invalid ``repo_id``. PublishError: offline mode or no token.
    """
    check_repo_id(repo_id)
    check_online()
    resolve_token()


def commit_groups(paths: list[str]) -> list[tuple[str, list[str]]]:
    """Split repository paths into :data:`COMMIT_GROUPS` (empty groups dropped), each path in its first match."""
    remaining = sorted(paths)
    groups = []
    for label, patterns in COMMIT_GROUPS:
        members = [p for p in remaining if any(fnmatch(p, pat) for pat in patterns)]
        remaining = [p for p in remaining if p not in members]
        if members:
            groups.append((label, members))
    return groups


def upload_repo_folder(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> UploadResult:
    """Create ``repo_id`` if needed and upload ``folder`` to ``revision`` in the commits of :data:`COMMIT_GROUPS`.

    Args:
        folder: the repository folder (:func:`~medusa_train.publish.folder.write_repo_folder`).
        repo_id: ``namespace/name``.
        private: visibility when the repository is created (an existing one keeps its own).
        revision: branch (created from ``main`` when missing); default ``main``.
        commit_message: first line of each commit (the group is appended).
        endpoint: the Hub (default ``$HF_ENDPOINT`` or huggingface.co).

    Raises:
        ValueError: invalid ``repo_id`` (before any request).
        PublishError: no token, offline mode, or a failure at the Hub (a rejected token or card, no write access)
            or on the network: what was committed and what was not is listed; re-running resumes.
    """
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    check_online()
    token = resolve_token()
    branch = revision or "main"
    paths = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    groups = commit_groups(paths)
    api = HfApi(endpoint=hub_endpoint(endpoint), token=token, library_name="medusa-train",
                library_version=__version__)
    result = UploadResult(repo_id, branch, "")
    message = commit_message or f"Publish Medusa heads with medusa-train {__version__}"
    with redacted_logs(token):
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            if branch != "main":
                api.create_branch(repo_id, branch=branch, exist_ok=True)
        except _hub_errors() as e:
            raise _failure(e, f"could not create {repo_id}", token, [], paths) from _cause(e, token)
        result.url = str(url) if branch == "main" else f"{url}/tree/{branch}"
        log.info("publishing %d files to %s (%s) in %d commit(s)", len(paths), repo_id, branch, len(groups))
        for i, (label, members) in enumerate(groups):
            try:
                info = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=branch,
                                         allow_patterns=[glob.escape(p) for p in members],
                                         commit_message=f"{message} ({i + 1}/{len(groups)}: {label})")
            except Exception as e:  # noqa: BLE001  any failure here (HTTP, network, Xet storage, a rejected card)
                # must say what is already committed; the original error stays chained unless it shows the token
                pending = [p for p in paths if p not in result.files]
                raise _failure(e, f"uploading the {label} of {repo_id}@{branch} failed", token, result.files,
                               pending) from _cause(e, token)
            if info.oid and info.oid not in result.commits:
                result.commits.append(info.oid)
            result.files.extend(members)
            log.info("committed %s: %s", label, ", ".join(members))
    return result


def _hub_errors() -> tuple[type[BaseException], ...]:
    import httpx2  # huggingface_hub's HTTP client; its errors include HfHubHTTPError

    return (httpx2.HTTPError, OSError)


def _reason(error: BaseException) -> str:
    """A short, actionable description of a Hub failure."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if not isinstance(error, HfHubHTTPError):
        return f"{type(error).__name__}: {error}"
    status = getattr(error.response, "status_code", None)
    said = f" (the Hub said: {error.server_message.strip()})" if error.server_message else ""
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized){said}: {LOGIN_HINT}"
    if status == 403:
        return f"the token may not write there (403 Forbidden){said}: check the namespace and the token's write access"
    if isinstance(error, RepositoryNotFoundError):
        return f"the repository was not found (404){said}: check repo_id and the token's access"
    return f"the Hub answered {status}: {error}"


def _failure(error: BaseException, what: str, token: str, committed: list[str], pending: list[str]) -> PublishError:
    committed_text = ", ".join(committed) if committed else "nothing"
    text = (f"{what}: {_reason(error)}\nAlready committed: {committed_text}.\n"
            f"Not uploaded: {', '.join(pending) or 'nothing'}.\n{RESUME_HINT}")
    return PublishError(redact(text, token), committed, pending)


def _cause(error: BaseException, token: str) -> BaseException | None:
    """``error`` to chain as the cause, or None when its text (or its own causes') would show the token."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if token in str(current) or token in repr(current.args):
            return None
        current = current.__cause__ or current.__context__
    return error


class _RedactFilter(logging.Filter):
    def __init__(self, secret: str) -> None:
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.secret in message:
            record.msg, record.args = redact(message, self.secret), None
        return True


@contextmanager
def redacted_logs(secret: str) -> Iterator[None]:
    """Mask ``secret`` in every record reaching the root logger's or huggingface_hub's handlers meanwhile."""
    if not secret:
        yield
        return
    handlers = {*logging.getLogger().handlers, *logging.getLogger("huggingface_hub").handlers}
    redactor = _RedactFilter(secret)
    for handler in handlers:
        handler.addFilter(redactor)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(redactor)
