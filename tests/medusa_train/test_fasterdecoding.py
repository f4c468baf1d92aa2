"""FasterDecoding's own loader opens our export: ``medusa.model.medusa_model.MedusaModel.from_pretrained(export)`` of
PyPI ``medusa-llm==0.1`` (FasterDecoding/Medusa v0.1), run in its own environment (``launch/install_fasterdecoding.sh``:
its patched Llama needs transformers 4.31) on a tiny random Llama saved as an HF folder.

It loads ``medusa_lm_head.pt`` with ``load_state_dict(strict=False)``, which ignores missing keys, so loading without
an error proves nothing: the test compares the weights it ended up with and the head logits of its own forward pass
with ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from medusa_train.export import save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.loading.export import load_export
from medusa_train.files.paths import PACKAGE_DIR
from tests.conftest import make_tiny_model, make_tiny_tokenizer

VENV = Path(os.environ.get("MEDUSA_FASTERDECODING_VENV") or PACKAGE_DIR.parent / ".venv-fasterdecoding")
PYTHON = VENV / "bin" / "python"
INPUT_IDS = [[1, 5, 9, 33, 60, 7, 8, 41, 12]]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / ".medusa-installed").is_file(),
                       reason=f"FasterDecoding's environment is not installed at {VENV}: run "
                              "`bash launch/install_fasterdecoding.sh` (CI does; MEDUSA_FASTERDECODING_VENV moves it)"),
]

# Runs in FasterDecoding's environment: its loader, its forward pass, its heads' state.
PROBE = textwrap.dedent("""
    import sys, torch
    from medusa.model.medusa_model import MedusaModel
    model = MedusaModel.from_pretrained(sys.argv[1])
    ids = torch.tensor(%r)
    with torch.inference_mode():
        logits = model(ids)                                  # [K, B, T, V]
        hidden = model.base_model.model(input_ids=ids)[0]    # [B, T, H]
    torch.save({"logits": logits, "hidden": hidden, "heads": model.medusa_head.state_dict(),
                "num_heads": model.medusa}, sys.argv[2])
""") % (INPUT_IDS,)


def base_folder(root: Path) -> tuple[torch.nn.Module, Path]:
    """A tiny random Llama and its tokenizer saved as an HF folder that transformers 4.31 reads too."""
    base = make_tiny_model("llama")
    folder = root / "base"
    base.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    # transformers 5 names its tokenizer class "TokenizersBackend", which 4.31 lacks; the file is the same fast
    # tokenizer, which 4.31 calls PreTrainedTokenizerFast
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    return base, folder


@pytest.mark.parametrize("share", [False, True], ids=["own_projections", "share_lm_head"])
def test_fasterdecoding_loader_gives_our_heads_and_our_head_logits(tmp_path, share):
    base, folder = base_folder(tmp_path)
    spec = HeadsSpec(3, 1, base.config.hidden_size, base.config.vocab_size, share_lm_head=share)
    heads = MedusaHeads(spec)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    export = tmp_path / "export"
    save_export(heads, export, str(folder), base_model=base, vllm=False)

    out = tmp_path / "fasterdecoding.pt"
    run = subprocess.run([str(PYTHON), "-c", PROBE, str(export), str(out)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(out, weights_only=True)

    # the weights FasterDecoding's heads hold after its strict=False load are ours, key for key
    assert theirs["num_heads"] == 3
    lm_head = base.lm_head.weight.detach()
    for h in range(3):
        assert torch.equal(theirs["heads"][f"{h}.0.linear.weight"], heads.block_weight[h, 0])
        assert torch.equal(theirs["heads"][f"{h}.0.linear.bias"], heads.block_bias[h, 0])
        assert torch.equal(theirs["heads"][f"{h}.1.weight"], lm_head if share else heads.lm_head_weight[h])

    # its forward pass over the same tokens gives our head logits
    model, _, _ = load_export(str(export))
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        hidden, _ = model.hidden(ids)
        ours = model.head_logits(hidden)  # [K, B, T, V]
        on_their_hidden = model.head_logits(theirs["hidden"])
    assert ours.shape == theirs["logits"].shape == (3, 1, len(INPUT_IDS[0]), spec.vocab_size)
    torch.testing.assert_close(theirs["hidden"], hidden, rtol=1e-5, atol=1e-5)  # its patched Llama vs transformers 5
    torch.testing.assert_close(theirs["logits"], on_their_hidden, rtol=1e-6, atol=1e-6)  # the heads alone
    torch.testing.assert_close(theirs["logits"], ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))
