"""The memory plan's vocabulary: a named number of bytes (:class:`Term`), a stage's terms per GPU and per host
(:class:`Stage`) and the whole plan against the machine (:class:`MemoryPlan`).

Every figure is in bytes (ints); GiB = 2**30 bytes only where a plan is printed. A term carries the formula it was
computed from, so a reader can check it by hand. The figures are planned from parameter counts and shapes, not
measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medusa_train.runs.disk_space import GIB  # bytes in a GiB (torch.cuda's total_memory is usually quoted in GiB)


def gib(n_bytes: int | float) -> float:
    """``n_bytes`` in GiB (2**30 bytes)."""
    return n_bytes / GIB


@dataclass(frozen=True)
class Term:
    """One named share of a stage's memory.

    Attributes:
        name: what it is (``heads params``, ``KV cache``).
        bytes: its size in bytes (>= 0).
        formula: how ``bytes`` was computed, with the numbers put in (``4,471,128,064 params x 2 B``).
    """

    name: str
    bytes: int
    formula: str

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ValueError(f"memory term {self.name!r} is negative ({self.bytes} bytes)")


@dataclass(frozen=True)
class Stage:
    """What one stage of a run needs on each GPU and on each host (node), and what the plan chose for it.

    Attributes:
        name: ``self_distill``, ``cache_build``, ``training`` or ``export``.
        gpu: the terms held at once on one GPU (the peak of the stage).
        host: the terms held at once in one host's RAM (all its GPUs' processes together).
        disk: the terms written to disk (bytes), if any.
        choices: what the plan chose for the stage (``tensor_parallel_size``: 4), for the reader and the JSON.
        notes: sentences a reader needs (what was assumed, what a setting would change).
    """

    name: str
    gpu: tuple[Term, ...] = ()
    host: tuple[Term, ...] = ()
    disk: tuple[Term, ...] = ()
    choices: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def gpu_bytes(self) -> int:
        """Bytes one GPU holds at the stage's peak (the sum of :attr:`gpu`)."""
        return sum(t.bytes for t in self.gpu)

    @property
    def host_bytes(self) -> int:
        """Bytes one host holds at the stage's peak (the sum of :attr:`host`)."""
        return sum(t.bytes for t in self.host)

    @property
    def disk_bytes(self) -> int:
        return sum(t.bytes for t in self.disk)


@dataclass(frozen=True)
class MemoryPlan:
    """The stages of a run against the memory of its machine.

    Attributes:
        stages: the stages the run goes through, in order.
        gpus: GPUs the run uses (the world size), ``gpus_per_host`` of them per host.
        gpu_capacity: bytes of one GPU (``total_memory``).
        host_capacity: bytes of one host's RAM (None: not checked).
        summary: the model and heads planned for (names and parameter counts), for the reader and the JSON.
        device: what a rank's device is called in messages: ``GPU``, or ``CPU rank`` on a CPU run (its share of the
            host's RAM).
    """

    stages: tuple[Stage, ...]
    gpus: int
    gpus_per_host: int
    gpu_capacity: int
    host_capacity: int | None
    summary: dict[str, Any] = field(default_factory=dict)
    device: str = "GPU"

    def stage(self, name: str) -> Stage:
        """The stage ``name`` (KeyError when the plan has none)."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def problems(self) -> list[tuple[Stage, str, int, int]]:
        """``(stage, device or "host", needed bytes, available bytes)`` for each stage that does not fit."""
        out = []
        for s in self.stages:
            if s.gpu_bytes > self.gpu_capacity:
                out.append((s, self.device, s.gpu_bytes, self.gpu_capacity))
            if self.host_capacity is not None and s.host_bytes > self.host_capacity:
                out.append((s, "host", s.host_bytes, self.host_capacity))
        return out

    @property
    def fits(self) -> bool:
        """Every stage fits one GPU and one host."""
        return not self.problems()

    @property
    def peak_gpu_bytes(self) -> int:
        """The largest stage's bytes on one GPU."""
        return max((s.gpu_bytes for s in self.stages), default=0)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values: ``fits``, ``peak_gib_per_gpu`` and per stage its GPU/host/disk GiB,
        choices and terms (bytes)."""
        return {
            "fits": self.fits, "peak_gib_per_gpu": round(gib(self.peak_gpu_bytes), 3), "gpus": self.gpus,
            "gpu_gib": round(gib(self.gpu_capacity), 3),
            "host_gib": None if self.host_capacity is None else round(gib(self.host_capacity), 3),
            **self.summary,
            "stages": {s.name: {"gpu_gib": round(gib(s.gpu_bytes), 3), "host_gib": round(gib(s.host_bytes), 3),
                                "disk_gib": round(gib(s.disk_bytes), 3), "fits": s not in [p[0] for p in
                                                                                           self.problems()],
                                **s.choices,
                                "gpu_terms": {t.name: t.bytes for t in s.gpu},
                                "host_terms": {t.name: t.bytes for t in s.host}}
                       for s in self.stages},
        }

    def table(self, terms: bool = True) -> str:
        """A readable table: per stage its GPU and host GiB (and with ``terms`` every term and its formula)."""
        lines = [f"{'stage':<14}{'GPU GiB':>10}{'host GiB':>10}{'disk GiB':>10}  fits",
                 "-" * 52]
        failing = {id(p[0]) for p in self.problems()}
        for s in self.stages:
            lines.append(f"{s.name:<14}{gib(s.gpu_bytes):>10.2f}{gib(s.host_bytes):>10.2f}{gib(s.disk_bytes):>10.2f}"
                         f"  {'no' if id(s) in failing else 'yes'}")
            if terms:
                for where, group in (("gpu", s.gpu), ("host", s.host), ("disk", s.disk)):
                    for t in group:
                        lines.append(f"    {where:<5}{t.name:<34}{gib(t.bytes):>9.3f} GiB  = {t.formula}")
                for key, value in s.choices.items():
                    lines.append(f"    chose {key} = {value}")
                for note in s.notes:
                    lines.append(f"    note: {note}")
        host = "unchecked" if self.host_capacity is None else f"{gib(self.host_capacity):.1f} GiB"
        lines.append(f"{self.gpus} x {self.device} of {gib(self.gpu_capacity):.1f} GiB ({self.gpus_per_host} per host, "
                     f"host RAM {host}); peak {gib(self.peak_gpu_bytes):.2f} GiB per {self.device}: "
                     f"{'fits' if self.fits else 'does not fit'} (planned from shapes, not measured)")
        return "\n".join(lines)


def term(name: str, count: int | float, unit_bytes: int | float, what: str, divide: int = 1) -> Term:
    """The term ``count x unit_bytes / divide`` (rounded up to a byte), its formula written out.

    Args:
        what: the name of ``count``'s unit (``params``, ``tokens``).
        divide: the ranks a sharded term is divided over (1: whole on each).
    """
    value = -(-int(count * unit_bytes) // divide)
    share = f" / {divide} ranks" if divide > 1 else ""
    return Term(name, value, f"{int(count):,} {what} x {unit_bytes:g} B{share}")


__all__ = ["GIB", "MemoryPlan", "Stage", "Term", "gib", "term"]
