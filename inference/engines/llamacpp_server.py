"""llama.cpp's ``llama-server`` driven from ours: one server process per decoder, started once, sent token-id prompts
on its native ``POST /completion`` endpoint, its speculative-decoding counters read from ``GET /metrics``.

The binary comes from ``launch/install_llamacpp.sh`` (:func:`medusa_train.engines.llamacpp_env.llamacpp_binary`). With a
drafter GGUF the server runs llama.cpp's EAGLE-3 (``--spec-type draft-eagle3 -md DRAFTER``,
``common/speculative.cpp``) or, with ``spec_type="draft-simple"``, a separate draft model: the drafter proposes a chain
of at most ``--spec-draft-n-max`` tokens (cut short where its top-1 probability falls below ``--spec-draft-p-min``,
or by the tokens left), the target verifies it in one pass. ``spec_type="ngram-simple"`` drafts without a model: the
tokens that followed the latest earlier occurrence of the last n tokens (``--spec-ngram-simple-size-n/-m``).

Requests (llama.cpp build 11434, ``tools/server``): ``prompt`` as token ids (continued exactly, no BOS added, no
chat template), ``n_predict``, greedy (``temperature`` 0, ``top_k`` 1), ``cache_prompt`` false (no prompt reuse
between requests: each is timed from an empty cache, as ours), ``return_tokens`` true (the reply's ids). The server
stops at the model's end-of-generation tokens unless ``ignore_eos``.

Counters: the server adds a request's ``n_draft_verif_steps``, draft tokens, accepted tokens and accepted tokens per
draft position to its Prometheus metrics (``--metrics``: ``llamacpp:spec_decode_num_drafts_total``, ...) when the
slot is released, before it reads the next task, so the difference of :meth:`LlamaServer.spec_counters` around one
request is that request's.

Timed beside our decoders, the server must be idle for real between its turns (ggml's worker threads poll after each
graph): with ``pause_when_idle`` its process is stopped (``SIGSTOP``) whenever no request is in flight and continued
for the next; a reaper (:func:`medusa_train.engines.vllm_env.start_reaper`) kills it when our process dies without
closing it. Threads: ``-t`` / ``-tb`` (and the drafter's ``-td`` / ``-tbd``) set to ``threads``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from medusa_train.engines.llamacpp_env import REPACK, llamacpp_binary
from medusa_train.engines.openai_client import ServerError, _call
from medusa_train.engines.vllm_env import start_reaper

SERVER_BINARY = "llama-server"
_COUNTER = re.compile(r"^llamacpp:(spec_decode_num_\w+?)_total(?:\{position=\"(\d+)\"\})?\s+(\S+)$")


class LlamaCppError(RuntimeError):
    """The server failed to start or to answer; the message holds the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_spec_counters(text: str) -> dict[str, Any]:
    """The speculative-decoding counters of a ``GET /metrics`` answer: ``num_drafts`` (verifying passes that carried
    drafts), ``num_draft_tokens``, ``num_accepted_tokens`` and ``accepted_per_pos`` (``[K]``, accepted drafts per
    position); zeros when the server has served no draft."""
    counters: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line.strip())
        if not match:
            continue
        name, position, value = match.group(1), match.group(2), int(float(match.group(3)))
        if position is not None and name == "spec_decode_num_accepted_tokens_per_pos":
            per_pos[int(position)] = value
        elif name.startswith("spec_decode_num_"):
            counters[name[len("spec_decode_"):]] = value
    counters["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return counters


def counter_difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two :func:`parse_spec_counters` results (per position: the longer list, zero-padded)."""
    k = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    pad = lambda values: list(values) + [0] * (k - len(values))  # noqa: E731
    return {**{key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_pos": [a - b for a, b in zip(pad(after["accepted_per_pos"]),
                                                      pad(before["accepted_per_pos"]))]}




class LlamaServer:
    """One ``llama-server`` on a free local port, plain or speculative, until :meth:`close` (the decoder closes it;
    ``contextlib.closing`` for a ``with`` block; the reaper kills it if our process dies first).

    Args:
        model_gguf: the target's GGUF.
        draft_gguf: the drafter's GGUF: an EAGLE-3 drafter
            (:func:`medusa_train.drafters.eagle3.gguf.export_eagle3_gguf`) or a draft model
            (``spec_type="draft-simple"``); None: no drafter.
        draft_max: longest drafted chain (``--spec-draft-n-max``); used with ``draft_gguf`` only.
        draft_p_min: the drafter's top-1 probability below which it stops drafting (``--spec-draft-p-min``; None:
            llama.cpp's default).
        threads: compute threads of the target and of the drafter (``-t``, ``-tb``, ``-td``, ``-tbd``).
        ctx_size: context tokens (prompt + reply + drafts).
        pause_when_idle: stop the server between requests (see the module docstring).
        repack: llama.cpp's weight repacking (``--repack`` / ``--no-repack``; default
            :data:`~medusa_train.engines.llamacpp_env.REPACK`).
        start_timeout: seconds to wait for the server to load both models.
        log_path: where its output goes (default: a temporary file, named in errors).
        spec_type: llama.cpp's ``--spec-type`` (``draft-eagle3``, ``draft-simple``, ``ngram-simple``, ...; with a
            ``draft_gguf``, the drafter's kind, named by whoever gives it); None: plain decoding.
        spec_options: further arguments of that type (e.g. ``["--spec-ngram-simple-size-n", "3"]``).

    Raises:
        ValueError: a ``draft_gguf`` without its ``spec_type``.
        LlamaCppUnavailable: llama.cpp is not installed.
        LlamaCppError: the server exited or did not answer ``/health`` within ``start_timeout`` (its log's tail).
    """

    def __init__(self, model_gguf: str | os.PathLike[str], draft_gguf: str | os.PathLike[str] | None = None,
                 draft_max: int = 3, draft_p_min: float | None = None, threads: int = 1, ctx_size: int = 4096,
                 pause_when_idle: bool = False, repack: bool = REPACK, start_timeout: float = 300.0,
                 log_path: str | os.PathLike[str] | None = None, spec_type: str | None = None,
                 spec_options: Sequence[str] = ()) -> None:
        binary = llamacpp_binary(SERVER_BINARY)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if spec_type is None and draft_gguf is not None:
            raise ValueError(f"a drafter GGUF ({draft_gguf}) needs its spec_type (llama.cpp's --spec-type)")
        self.speculative = spec_type is not None
        self.pause_when_idle = pause_when_idle
        self._paused = False
        command = [str(binary), "-m", str(model_gguf), "--host", "127.0.0.1", "--port", str(self.port),
                   "-c", str(ctx_size), "-np", "1", "-t", str(threads), "-tb", str(threads), "--metrics",
                   "--no-webui", "--seed", "0", "--repack" if repack else "--no-repack"]
        if spec_type is not None:
            command += ["--spec-type", spec_type, *map(str, spec_options)]
        if draft_gguf is not None:
            command += ["-md", str(draft_gguf), "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
                        "-td", str(threads), "-tbd", str(threads)]
            if draft_p_min is not None:
                command += ["--spec-draft-p-min", str(draft_p_min)]
        self.command = command
        if log_path is None:  # a file that stays after close: errors name it
            with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False) as handle:
                log_path = handle.name
        self.log_path = Path(log_path)
        with open(self.log_path, "ab") as log:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._reaper: subprocess.Popen = start_reaper(os.getpid(), self._proc.pid)
        self.info: dict[str, Any] = {"command": command, "log": str(self.log_path)}
        start = time.perf_counter()
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise
        self.info["start_s"] = time.perf_counter() - start
        self.info["version"] = self._version()
        if pause_when_idle:
            self._signal(signal.SIGSTOP)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited with status {self._proc.returncode if self._proc else '?'} "
                                    f"while starting:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading the models
                pass
            time.sleep(0.2)
        raise LlamaCppError(f"llama-server did not answer {self.url}/health within {timeout:.0f} s:\n"
                            f"{self._log_tail()}")

    def _version(self) -> str:
        match = re.search(r"build:?\s*(\d+)\s*\((\w+)\)", self.log_path.read_text(errors="replace"))
        return f"b{match.group(1)} ({match.group(2)})" if match else "unknown"

    def _signal(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:  # gone: the next request reports how it ended
            pass
        self._paused = sig == signal.SIGSTOP

    def _request(self, path: str, payload: dict[str, Any] | None, timeout: float) -> Any:
        if self._proc is None:
            raise LlamaCppError("llama-server was closed")
        if self._paused:
            self._signal(signal.SIGCONT)
        try:
            if payload is None:  # /metrics answers text
                with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as response:
                    return response.read().decode("utf-8", errors="replace")
            return _call(f"{self.url}{path}", payload, timeout)
        except (ServerError, urllib.error.URLError, OSError) as e:
            status = self._proc.poll()
            how = f"exited with status {status}" if status is not None else "failed"
            raise LlamaCppError(f"llama-server {how} on {path}: {e}\n{self._log_tail()}") from e

    def spec_counters(self) -> dict[str, Any]:
        """The server's speculative-decoding counters so far (:func:`parse_spec_counters`)."""
        return parse_spec_counters(self._request("/metrics", None, 30.0))

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, ignore_eos: bool = False,
                 timeout: float = 3600.0, n_probs: int = 0) -> dict[str, Any]:
        """One greedy reply to ``prompt_ids``: ``tokens`` (ids), ``wall_s`` (the request, seconds, measured here),
        ``timings`` (the server's: ``prompt_ms``, ``predicted_ms``, ``draft_n``, ``draft_n_accepted``, ...),
        ``stop_type`` (``eos``, ``limit``, ...) and ``spec`` (this request's counters, :func:`counter_difference`;
        zeros for a plain server). ``n_probs`` > 0 adds ``probs``: llama.cpp's ``completion_probabilities``, for each
        reply token its ``n_probs`` most likely tokens with their log-probabilities before sampling.

        Raises:
            LlamaCppError: the server failed or answered without token ids (its log's tail).
        """
        payload = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_tokens), "temperature": 0.0,
                   "top_k": 1, "cache_prompt": False, "return_tokens": True, "ignore_eos": bool(ignore_eos),
                   "stream": False}
        if n_probs:
            payload["n_probs"] = int(n_probs)
        try:
            before = self.spec_counters() if self.speculative else None
            start = time.perf_counter()
            answer = self._request("/completion", payload, timeout)
            wall = time.perf_counter() - start
            spec = counter_difference(self.spec_counters(), before) if before is not None else None
        finally:
            if self.pause_when_idle:
                self._signal(signal.SIGSTOP)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise LlamaCppError(f"llama-server answered without the reply's token ids: {str(answer)[:300]}")
        return {"tokens": tokens, "wall_s": wall, "timings": answer.get("timings") or {},
                "stop_type": answer.get("stop_type"),
                "probs": answer.get("completion_probabilities") if n_probs else None,
                "spec": spec or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                 "accepted_per_pos": []}}

    def _log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(text.splitlines()[-lines:]) + f"\n(full log: {self.log_path})"

    def close(self) -> None:
        """Stop the server (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=15)
        self._reaper.kill()
        self._reaper.wait()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LlamaCppError", "LlamaServer", "counter_difference", "free_port", "parse_spec_counters"]
