"""A local HTTP server speaking the part of the Hugging Face Hub API that ``huggingface_hub`` uploads and downloads use.

Tests start it on 127.0.0.1 with an ephemeral port and point ``HF_ENDPOINT`` (or ``endpoint=``) at
:attr:`HubServer.url`.
It keeps every repository in memory (revision -> path -> bytes), so a test can compare what arrived byte for byte.

Endpoints (as ``huggingface_hub`` 2.4 calls them, read from its client code):

- ``POST /api/repos/create``: ``{"name", "organization", "type", "visibility"}``; 409 when the repository exists.
- ``POST /api/validate-yaml``: ``{"content", "repoType"}``; checks a README's metadata block.
- ``POST /api/models/{repo}/preupload/{rev}``: every file ``uploadMode: "regular"`` (no LFS / Xet here), with the
  ``oid`` (git blob SHA-1) of the file already at that path, which is how ``huggingface_hub`` skips unchanged files.
- ``POST /api/models/{repo}/commit/{rev}``: NDJSON (``header``, ``file`` base64, ``deletedFile``, ``deletedFolder``).
- ``POST /api/models/{repo}/branch/{branch}``: a branch from ``startingPoint`` or the head of ``main``.
- ``GET /api/models/{repo}[/revision/{rev}]``, ``GET /api/models/{repo}/tree/{rev}``,
  ``HEAD|GET /{repo}/resolve/{rev}/{path}``: what ``model_info`` and ``snapshot_download`` read.

Write requests need ``Authorization: Bearer <token>`` with a token given to the server, whose user owns the
namespace. Errors follow the Hub's shape (JSON ``{"error": ...}``, ``X-Error-Code`` / ``X-Error-Message`` headers).
:meth:`HubServer.fail_after` makes the server drop connections without answering, as a network failure would.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    ("POST", "create", re.compile(r"/api/repos/create")),
    ("POST", "validate-yaml", re.compile(r"/api/validate-yaml")),
    ("POST", "preupload", re.compile(rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)")),
    ("POST", "commit", re.compile(rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)")),
    ("POST", "branch", re.compile(rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)")),
    ("GET", "tree", re.compile(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?")),
    ("GET", "info", re.compile(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?")),
    ("GET", "resolve", re.compile(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")),
    ("HEAD", "resolve", re.compile(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")),
]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a blob: what the Hub reports as a regular file's ``oid``."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


@dataclass
class Commit:
    oid: str
    revision: str
    message: str
    added: list[str]
    deleted: list[str]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit oid -> path -> content
    commits: list[Commit] = field(default_factory=list)

    def resolve(self, revision: str) -> str:
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.trees:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class HubServer:
    """The server; use as a context manager or call :meth:`start` / :meth:`stop`.

    Args:
        tokens: token -> user name of the accepted tokens.
        echo_auth_in_errors: a misbehaving server that copies the request's Authorization header into its error
            messages, to test that clients never show it.
    """

    def __init__(self, tokens: dict[str, str] | None = None, echo_auth_in_errors: bool = False) -> None:
        self.tokens = dict(tokens or {})
        self.echo_auth_in_errors = echo_auth_in_errors
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, endpoint name, path)
        self._lock = threading.Lock()
        self._fail: tuple[int, str | None] | None = None
        self._counts: dict[str | None, int] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- test controls ---------------------------------------------------------------------------------------

    def fail_after(self, n: int | None, endpoint: str | None = None) -> None:
        """Drop the connection of every request after the first ``n`` (of ``endpoint`` only, when given);
        ``None`` heals the server."""
        with self._lock:
            self._fail = None if n is None else (n, endpoint)
            self._counts = {}

    def add_repo(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> None:
        """Seed a repository (e.g. a base model with its README) with one commit on ``main``."""
        with self._lock:
            repo = self.repos[repo_id] = Repo(repo_id, private)
            self._commit(repo, "main", "initial commit", dict(files), list(files), [])

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """path -> content of ``repo_id`` at ``revision``."""
        with self._lock:
            repo = self.repos[repo_id]
            return dict(repo.trees[repo.resolve(revision)])

    def count(self, endpoint: str) -> int:
        return sum(1 for _, name, _ in self.requests if name == endpoint)

    # ---- state changes (called with the lock held) ------------------------------------------------------------

    def _commit(self, repo: Repo, branch: str, message: str, tree: dict[str, bytes], added: list[str],
                deleted: list[str]) -> str:
        parent = repo.branches.get(branch, "")
        digest = hashlib.sha1(parent.encode() + message.encode())
        for path in sorted(tree):
            digest.update(path.encode() + b"\0" + git_blob_sha1(tree[path]).encode())
        digest.update(str(len(repo.commits)).encode())
        oid = digest.hexdigest()
        repo.trees[oid] = tree
        repo.branches[branch] = oid
        repo.commits.append(Commit(oid, branch, message, added, deleted))
        return oid

    def _should_fail(self, endpoint: str) -> bool:
        if self._fail is None:
            return False
        n, only = self._fail
        if only is not None and endpoint != only:
            return False
        self._counts[only] = self._counts.get(only, 0) + 1
        return self._counts[only] > n


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read hub.requests instead
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # ---- plumbing ----------------------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        for verb, name, pattern in ROUTES:
            match = pattern.fullmatch(split.path)
            if verb == method and match:
                break
        else:
            name, match = "unknown", None
        hub = self.hub
        with hub._lock:
            hub.requests.append((method, name, split.path))
            fail = hub._should_fail(name)
        if fail:  # a network failure: no answer at all
            self.close_connection = True
            return
        if match is None:
            return self._error(HubError(404, f"no route for {method} {split.path}"))
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        try:
            with hub._lock:
                status, payload, headers = getattr(self, "_" + name.replace("-", "_"))(body=body, **args)
        except HubError as e:
            return self._error(e)
        self._send(status, payload, headers)

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes)
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, error: HubError) -> None:
        message = error.message
        if self.hub.echo_auth_in_errors:
            message += f" (request had Authorization: {self.headers.get('Authorization')})"
        headers = {"X-Error-Message": message}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._send(error.status, {"error": message, **error.extra}, headers)

    def _user(self, required: bool) -> str | None:
        auth = self.headers.get("Authorization") or ""
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
        user = self.hub.tokens.get(token) if token else None
        if token and user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        if required and user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_id: str, write: bool) -> Repo:
        user = self._user(required=write)
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and user != repo_id.split("/")[0]):
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write and user != repo_id.split("/")[0]:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    # ---- endpoints (lock held) ---------------------------------------------------------------------------------

    def _create(self, body: bytes) -> tuple[int, Any, dict]:
        user = self._user(required=True)
        data = json.loads(body)
        name, namespace = data.get("name") or "", data.get("organization") or user
        if data.get("type", "model") not in ("model", None):
            raise HubError(400, "this test server hosts models only")
        if not NAME.fullmatch(name) or name.endswith(".git") or ".." in name or "--" in name:
            raise HubError(400, f"Invalid repository name: {name!r}")
        if namespace != user:
            raise HubError(403, f"You don't have the rights to create a model under the namespace {namespace!r}")
        repo_id = f"{namespace}/{name}"
        if repo_id in self.hub.repos:
            # the Hub answers a conflict with the existing repository's URL, which create_repo(exist_ok=True) reads
            raise HubError(409, "You already created this model repo", extra={"url": f"{self.hub.url}/{repo_id}"})
        private = data.get("visibility", "public") == "private" or bool(data.get("private"))
        repo = self.hub.repos[repo_id] = Repo(repo_id, private)
        self.hub._commit(repo, "main", "initial commit", {".gitattributes": b"*.safetensors filter=lfs\n"},
                         [".gitattributes"], [])
        return 200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id}, {}

    def _validate_yaml(self, body: bytes) -> tuple[int, Any, dict]:
        errors = [{"message": m} for m in readme_metadata_errors(json.loads(body).get("content", ""))]
        return (400 if errors else 200), {"errors": errors, "warnings": []}, {}

    def _preupload(self, body: bytes, repo: str, rev: str) -> tuple[int, Any, dict]:
        r = self._repo(repo, write=True)
        tree = r.trees[r.resolve(rev)]
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": git_blob_sha1(tree[f["path"]]) if f["path"] in tree else None}
                 for f in json.loads(body)["files"]]
        return 200, {"files": files, "commitOid": r.resolve(rev)}, {}

    def _commit(self, body: bytes, repo: str, rev: str) -> tuple[int, Any, dict]:
        r = self._repo(repo, write=True)
        if rev not in r.branches:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        tree = dict(r.trees[r.branches[rev]])
        header, added, deleted = {}, [], []
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                tree[value["path"]] = base64.b64decode(value["content"])
                added.append(value["path"])
            elif key == "deletedFile":
                if tree.pop(value["path"], None) is None:
                    raise HubError(404, f"{value['path']} does not exist", "EntryNotFound")
                deleted.append(value["path"])
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for path in [p for p in tree if p.startswith(prefix)]:
                    del tree[path]
                    deleted.append(path)
            else:
                raise HubError(400, f"this test server does not take {key!r} entries (LFS/Xet)")
        parent = header.get("parentCommit")
        if parent and parent != r.branches[rev]:
            raise HubError(412, "A commit has happened since the parent commit; pull and retry")
        oid = self.hub._commit(r, rev, header.get("summary", ""), tree, added, deleted)
        return 200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                     "pullRequestUrl": None}, {}

    def _branch(self, body: bytes, repo: str, rev: str) -> tuple[int, Any, dict]:
        r = self._repo(repo, write=True)
        if rev in r.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{rev}")
        start = (json.loads(body) if body else {}).get("startingPoint") or "main"
        r.branches[rev] = r.resolve(start)
        return 200, {}, {}

    def _info(self, body: bytes, repo: str, rev: str = "main") -> tuple[int, Any, dict]:
        r = self._repo(repo, write=False)
        oid = r.resolve(rev)
        tree = r.trees[oid]
        info: dict[str, Any] = {"id": repo, "sha": oid, "private": r.private,
                                "siblings": [{"rfilename": p} for p in sorted(tree)]}
        if "README.md" in tree:
            meta = readme_metadata(tree["README.md"].decode())
            if isinstance(meta, dict):
                info["cardData"] = meta
        return 200, info, {}

    def _tree(self, body: bytes, repo: str, rev: str, path: str = "") -> tuple[int, Any, dict]:
        r = self._repo(repo, write=False)
        tree = r.trees[r.resolve(rev)]
        prefix = path.strip("/") + "/" if path else ""
        entries = [{"type": "file", "path": p, "size": len(c), "oid": git_blob_sha1(c)}
                   for p, c in sorted(tree.items()) if p.startswith(prefix)]
        if self.query.get("recursive", ["false"])[0].lower() != "true":
            depth = prefix.count("/")
            entries = [e for e in entries if e["path"].count("/") == depth]
        return 200, entries, {}

    def _resolve(self, body: bytes, repo: str, rev: str, path: str) -> tuple[int, Any, dict]:
        r = self._repo(repo, write=False)
        oid = r.resolve(rev)
        tree = r.trees[oid]
        if path not in tree:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        content = tree[path]
        return 200, content, {"X-Repo-Commit": oid, "ETag": f'"{git_blob_sha1(content)}"'}


# ---------------------------------------------------------------- README metadata, as the Hub checks it


def readme_metadata(content: str) -> Any:
    """The YAML block between the leading ``---`` lines of a README, parsed (None without one)."""
    match = re.match(r"\A---\s*\n(.*?\n)---\s*(\n|\Z)", content, re.DOTALL)
    return yaml.safe_load(match.group(1)) if match else None


def readme_metadata_errors(content: str) -> list[str]:
    """What the Hub would reject in a model card's metadata: malformed YAML and wrongly typed known fields."""
    try:
        meta = readme_metadata(content)
    except yaml.YAMLError as e:
        return [f"metadata is not valid YAML: {e}"]
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return ["metadata must be a YAML mapping"]
    errors = []
    for key in ("license", "library_name", "pipeline_tag", "license_name", "license_link"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("tags", "datasets"):
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(t, str) for t in meta[key])):
            errors.append(f'"{key}" must be a list of strings')
    if "base_model" in meta:
        base = meta["base_model"]
        if not (isinstance(base, str) or (isinstance(base, list) and all(isinstance(b, str) for b in base))):
            errors.append('"base_model" must be a string or a list of strings')
    for entry in meta.get("model-index") or []:
        for result in entry.get("results") or []:
            if not isinstance(result.get("task", {}).get("type"), str):
                errors.append('"model-index[].results[].task.type" must be a string')
            dataset = result.get("dataset", {})
            if not (isinstance(dataset.get("name"), str) and isinstance(dataset.get("type"), str)):
                errors.append('"model-index[].results[].dataset" needs "name" and "type"')
            for metric in result.get("metrics") or []:
                if "type" not in metric or "value" not in metric:
                    errors.append('"model-index[].results[].metrics[]" needs "type" and "value"')
    return errors
