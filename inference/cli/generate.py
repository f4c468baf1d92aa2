"""``medusa-generate export_dir=DIR prompt=TEXT``: one chat reply from an export, streamed, with its stats.

The reply is streamed to stdout as it is decided; then one line gives the new tokens, the wall time, tokens per
second, the mean accepted tokens (τ, see :mod:`inference.decoders.base`) and the stop reason. Settings:
:class:`GenerateConfig` (``conf/generate.yaml``) and, per decoder, ``conf/decoder/<name>.yaml`` (the same files
``medusa-eval`` reads), e.g. ``decoder.tree.acceptance=speculative``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig
from transformers import TextStreamer

from inference.conf import CONF_DIR
from inference.decoders import DecodeConfig, DecodeResult
from inference.decoders import generate as chat_generate
from inference.decoders.choices import resolve_medusa_choices
from inference.registry import (
    BuildContext,
    build_decoder,
    check_decoder_names,
    decoder_settings,
    register_decoder_schemas,
)
from medusa_train.config.bounds import MAX_COUNT, MAX_SEED, MAX_TOKENS, bound, check_bounds
from medusa_train.cli.app import hydra_app, register_shared_schemas
from medusa_train.config.schema import as_dataclass, check_device
from medusa_train.export.files import check_readable
from medusa_train.loading.cpu_kernels import DEFAULT_CPU_KERNELS, check_cpu_kernels
from medusa_train.loading.runtime import load_for_inference
from medusa_train.config.precision import DEFAULT_DTYPE, check_dtype_name
from medusa_train.tree.sampling import SAMPLING_DEFAULTS


@dataclass
class GenerateConfig:
    """Settings of ``medusa-generate``.

    Attributes:
        export_dir: the export folder (heads, ``config.json``, optionally ``medusa_choices.json``).
        prompt: the user message (the tokenizer's chat template is applied when it has one).
        system: an optional system message.
        decoder_name: the decoder to run (``tree``; ``composite``: the heads' and prompt lookup's drafts in one
            tree; or ``vanilla`` for the plain-decoding baseline).
        decoder: settings per decoder name (``conf/decoder/<name>.yaml``).
        max_new_tokens: most tokens in the reply.
        temperature: 0 for greedy; > 0 samples (tree: with ``decoder.tree.acceptance`` speculative or typical).
        top_p, top_k: sampling filters (1.0 / 0: off).
        seed: sampling seed (None: random).
        stop_strings: the reply ends at the first of these.
        model: a ``model/`` config overriding the base model recorded in the export (e.g. ``model=smollm2_135m``).
        dtype: ``auto`` (bf16 where the hardware multiplies bf16 natively, fp32 elsewhere), a dtype name, or None for
            the model config's.
        device: overrides the model config's device.
        cpu_kernels: ``auto``, ``packed`` or ``none`` (:mod:`medusa_train.loading.cpu_kernels`).
    """

    export_dir: str = MISSING
    prompt: str = MISSING
    system: Optional[str] = None
    decoder_name: str = "tree"
    decoder: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = field(default=SAMPLING_DEFAULTS.max_new_tokens, metadata=bound(1, cap=MAX_TOKENS))
    temperature: float = field(default=SAMPLING_DEFAULTS.temperature, metadata=bound(0, hint="0: greedy"))
    top_p: float = field(default=SAMPLING_DEFAULTS.top_p, metadata=bound(0, 1, low_open=True, hint="1.0: off"))
    top_k: int = field(default=SAMPLING_DEFAULTS.top_k, metadata=bound(0, cap=MAX_COUNT, hint="0: off"))
    seed: Optional[int] = field(default=None, metadata=bound(0, MAX_SEED, hint="null: random"))
    stop_strings: list[str] = field(default_factory=list)
    model: Optional[Any] = None
    dtype: Optional[str] = DEFAULT_DTYPE
    device: Optional[str] = None
    cpu_kernels: str = DEFAULT_CPU_KERNELS

    def validate(self) -> None:
        """Check every setting before any model is loaded.

        Raises:
            ValueError: a bad value (the key named), an unknown decoder, or settings that do not fit together.
            FileNotFoundError: ``export_dir`` is not a folder.
            PermissionError: a file or folder of ``export_dir`` this user cannot read (named: ``check_readable``).
        """
        check_bounds(self)
        check_decoder_names([self.decoder_name])
        settings = self.settings()
        if getattr(settings, "acceptance", None) == "greedy" and self.temperature != 0:
            raise ValueError(
                f"temperature={self.temperature} with decoder.{self.decoder_name}.acceptance=greedy: set it to "
                "speculative (lossless) or typical to sample, or use temperature=0"
            )
        if not self.prompt:
            raise ValueError("prompt is empty: pass prompt=TEXT")
        check_dtype_name(self.dtype)
        check_cpu_kernels(self.cpu_kernels)
        if self.device is not None:
            check_device(self.device, "device")
        check_readable(self.export_dir)
        if not Path(self.export_dir).is_dir():
            raise FileNotFoundError(
                f"export_dir={self.export_dir!r} is not a folder (an export written by medusa-train)")
        self.request()  # checks stop_strings

    def settings(self) -> Any:
        """The validated settings of the chosen decoder."""
        return decoder_settings(self.decoder_name, self.decoder.get(self.decoder_name))

    def request(self, eos_token_ids: tuple[int, ...] = ()) -> DecodeConfig:
        """The generation request (EOS ids are filled from the tokenizer by the chat helper when empty)."""
        return DecodeConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k, eos_token_ids=eos_token_ids, stop_strings=tuple(self.stop_strings),
                            seed=self.seed)


def register_schemas() -> None:
    """What ``conf/generate.yaml`` composes from: ``generate_schema`` (:class:`GenerateConfig`),
    ``schema/decoder/<name>``, the shared schemas and resolvers (idempotent)."""
    register_shared_schemas()
    register_decoder_schemas()
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)


class TextOut(TextStreamer):
    """Hugging Face ``TextStreamer`` (word-buffered decoding) writing the reply to a text stream, prompt skipped."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def stats_line(name: str, result: DecodeResult) -> str:
    """One line of speed and acceptance numbers for a :class:`~inference.decoders.DecodeResult`."""
    tau = result.mean_accepted_tokens
    tau_text = "n/a (no decoding pass)" if math.isnan(tau) else f"{tau:.2f}"
    steps = ""
    if result.draft_time_s is not None and result.verify_time_s is not None and result.forward_passes:
        steps = (f", drafting {1000 * result.draft_time_s / result.forward_passes:.2f} ms + verification "
                 f"{1000 * result.verify_time_s / result.forward_passes:.2f} ms per pass")
    return (f"[{name}] {len(result.tokens)} tokens in {result.wall_time_s:.2f} s "
            f"({result.tokens_per_second:.1f} tokens/s), mean accepted tokens {tau_text}, "
            f"{result.forward_passes} decoding passes + prefill{steps}, stop: {result.stop_reason}")


def run(cfg: DictConfig | GenerateConfig, out: TextIO | None = None) -> DecodeResult:
    """Load the export and its base model, stream one reply to ``out`` (stdout), print its stats line.

    Returns:
        The :class:`~inference.decoders.DecodeResult`.

    Raises:
        ValueError / FileNotFoundError: bad settings, found before the model loads.
    """
    gc: GenerateConfig = as_dataclass(GenerateConfig, cfg)
    out = out or sys.stdout
    # The dtype and kernel decisions go to stderr: stdout holds the reply.
    model, tokenizer, _, runtime = load_for_inference(gc.export_dir, model=gc.model, dtype=gc.dtype, device=gc.device,
                                                      cpu_kernels=gc.cpu_kernels,
                                                      echo=lambda line: print(line, file=sys.stderr))
    context = BuildContext(model=model, tokenizer=tokenizer, export_dir=gc.export_dir, dtype=runtime.dtype.name,
                           device=gc.device, kernels=runtime.kernels)
    decoder = build_decoder(gc.decoder_name, gc.settings(), context).decoder
    result = chat_generate(decoder, tokenizer, gc.prompt, gc.request(), streamer=TextOut(tokenizer, out),
                           system=gc.system)
    print(stats_line(decoder.name, result), file=out)
    return result


@hydra_app("generate", example='medusa-generate export_dir=runs/stories/export prompt="Once upon a time"',
           register_schemas=register_schemas, conf_dir=CONF_DIR)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()


# ``resolve_medusa_choices`` is re-exported for callers that import it from here (inference.registry).
__all__ = ["GenerateConfig", "TextOut", "main", "register_schemas", "resolve_medusa_choices", "run", "stats_line"]
