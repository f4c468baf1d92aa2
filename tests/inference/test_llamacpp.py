"""llama.cpp beside our decoders: ``llamacpp`` (plain ``llama-server`` on the target's GGUF) and ``llamacpp_eagle3``
(its EAGLE-3 with our export's drafter, converted by llama.cpp's own converter).

Without llama.cpp: the counters' parsing and the pass lengths rebuilt from them, the settings, the refusals (sampling,
stop strings, a non-EAGLE-3 export, the wrong number of taps, a missing install) and the decoder over a stand-in
server. With it (``bash launch/install_llamacpp.sh``; the tests that need it skip, naming the command): the real
converter and server on SmolLM2-135M-Instruct's Q4_1 GGUF, a random drafter's greedy replies equal plain llama.cpp's
and its counters add up; a drafter trained by our pipeline on the prompts is accepted (slow).
"""

from __future__ import annotations

import json
from contextlib import closing

import pytest
import torch

from inference.decoders import DecodeConfig
from inference.decoders.llamacpp import LlamaCppDecoder, cut_at_eos, pass_lengths
from inference.engines.llamacpp_server import counter_difference, parse_spec_counters
from inference.registry import BuildContext, build_decoder, check_request, decoder_settings
from medusa_train.config.schema import ModelConfig
from medusa_train.models.catalog import new_spec
from medusa_train.drafters.eagle3.drafter import Eagle3Drafter
from medusa_train.export import save_export
from medusa_train.drafters.eagle3.gguf import drafter_gguf_path, export_eagle3_gguf, speculators_files
from medusa_train.drafters.eagle3.llamacpp import LlamaCppEagle3Settings
from medusa_train.engines.settings import LlamaCppSettings
from medusa_train.engines.llamacpp_env import LlamaCppUnavailable, llamacpp_available
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from tests.conftest import VOCAB, make_tiny_model
from tests.inference.test_vllm import smollm2  # noqa: F401 - fixture

METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 87
llamacpp:spec_decode_num_draft_tokens_total 30
llamacpp:spec_decode_num_accepted_tokens_total 14
llamacpp:spec_decode_num_drafts_total 10
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 2
"""


# ---------------------------------------------------------------- no llama.cpp needed


def test_spec_counters_parse_and_subtract():
    after = parse_spec_counters(METRICS)
    assert after == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 14,
                     "accepted_per_pos": [7, 5, 2]}
    assert parse_spec_counters("llamacpp:prompt_tokens_total 3\n") == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    before = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 5, "accepted_per_pos": [3, 2]}
    assert counter_difference(after, before) == {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 9,
                                                 "accepted_per_pos": [4, 3, 2]}


def test_pass_lengths_rebuild_the_reply_from_the_counters():
    spec = {"num_drafts": 6, "num_accepted_tokens": 9, "accepted_per_pos": [4, 3, 2]}
    # 6 chains emit 6 + 9 = 15 tokens; a 20-token reply had 19 after the prefill: 4 passes without a draft.
    lengths = pass_lengths(20, spec)
    assert lengths == [4, 4, 3, 2, 1, 1, 1, 1, 1, 1] and sum(lengths) == 19
    assert (20 - 1) / len(lengths) == pytest.approx(1.9)  # τ
    # an EOS inside the last chain: llama.cpp counted 2 drafts past the reply's end; the longest are trimmed
    trimmed = pass_lengths(14, spec)
    assert trimmed == [2, 4, 3, 2, 1, 1] and sum(trimmed) == 13
    assert pass_lengths(1, spec) == [] and pass_lengths(5, {"num_drafts": 0, "num_accepted_tokens": 0,
                                                             "accepted_per_pos": []}) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="does not add up"):
        pass_lengths(20, {**spec, "num_accepted_tokens": 8})
    assert cut_at_eos([5, 2, 7], (2,)) == ([5, 2], True) and cut_at_eos([5, 7], (2,)) == ([5, 7], False)


class StandIn:
    """A stand-in server: answers every request with ``tokens`` and ``spec``."""

    def __init__(self, tokens, spec):
        self.tokens, self.spec, self.calls, self.closed = tokens, spec, [], False

    def complete(self, ids, max_tokens, ignore_eos=False):
        self.calls.append((list(ids), max_tokens, ignore_eos))
        return {"tokens": self.tokens, "wall_s": 0.5, "timings": {"prompt_ms": 40.0}, "stop_type": "eos",
                "spec": self.spec}

    def close(self):
        self.closed = True


def test_decoder_counts_and_refusals():
    spec = {"num_drafts": 2, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]}
    server = StandIn([11, 12, 13, 14, 15, 16, 2, 9], spec)
    decoder = LlamaCppDecoder(server, "llamacpp_eagle3", ctx_size=64, draft_max=2)
    result = decoder.generate([1, 2, 3], DecodeConfig(max_new_tokens=8, eos_token_ids=(2,)))
    assert server.calls == [([1, 2, 3], 8, False)]
    assert result.tokens == [11, 12, 13, 14, 15, 16, 2] and result.stop_reason == "eos"
    assert result.accepted_lengths == [3, 2, 1] and result.forward_passes == 3  # 2 chains (3 + 2), one plain pass
    assert result.mean_accepted_tokens == pytest.approx(2.0)
    assert result.wall_time_s == 0.5 and result.prefill_time_s == pytest.approx(0.04) and result.prompt_tokens == 3
    decoder.generate([1], DecodeConfig(max_new_tokens=3))
    assert server.calls[-1] == ([1], 3, True)  # no EOS asked for: the server runs to max_new_tokens
    for config, message in ((DecodeConfig(max_new_tokens=4, temperature=0.7), "greedily only"),
                            (DecodeConfig(max_new_tokens=4, stop_strings=("x",)), "stop_strings"),
                            (DecodeConfig(max_new_tokens=62), r"max_new_tokens")):
        with pytest.raises(ValueError, match=message):
            decoder.generate([1, 2], config)
    decoder.close()
    assert server.closed


def test_settings_and_request_checks(monkeypatch, tmp_path):
    assert decoder_settings("llamacpp") == LlamaCppSettings()
    assert decoder_settings("llamacpp_eagle3", {"draft_max": 2}).draft_max == 2
    for raw, message in (({"outtype": "q4_k"}, "outtype='q4_k': choose one of f32, f16, bf16, q8_0"),
                         ({"draft_max": 0}, r"decoder.llamacpp_eagle3.draft_max"),
                         ({"draft_p_min": 1.5}, r"decoder.llamacpp_eagle3.draft_p_min")):
        with pytest.raises(ValueError, match=message):
            decoder_settings("llamacpp_eagle3", raw)
    with pytest.raises(ValueError, match="greedily only"):
        check_request("llamacpp", LlamaCppSettings(), DecodeConfig(max_new_tokens=4, temperature=1.0))
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", str(tmp_path / "none"))
    with pytest.raises(LlamaCppUnavailable, match=r"not found at .*none: run `bash launch/install_llamacpp.sh`"):
        check_request("llamacpp", LlamaCppSettings(), DecodeConfig(max_new_tokens=4))
    (tmp_path / "half").mkdir()
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", str(tmp_path / "half"))
    with pytest.raises(LlamaCppUnavailable, match=r"incomplete.*install_llamacpp.sh` again"):
        check_request("llamacpp_eagle3", LlamaCppEagle3Settings(), DecodeConfig(max_new_tokens=4))


def test_the_target_must_be_a_gguf_and_the_export_an_eagle3_with_three_taps(tmp_path):
    target = make_tiny_model(num_hidden_layers=8)
    hf = ModelConfig(name_or_path=str(tmp_path / "hf-model"))
    ctx = BuildContext(model=None, tokenizer=None, export_dir=str(tmp_path), model_config=hf)
    with pytest.raises(ValueError, match=r"decoder.llamacpp.target_gguf: llama.cpp loads models as GGUF files and "
                                         r".*hf-model is not one.*convert_hf_to_gguf.py"):
        build_decoder("llamacpp", LlamaCppSettings(), ctx)
    with pytest.raises(ValueError, match=r"decoder.llamacpp.target_gguf: .*missing.gguf does not exist"):
        build_decoder("llamacpp", LlamaCppSettings(target_gguf=str(tmp_path / "missing.gguf")), ctx)
    medusa = save_export(MedusaHeads(HeadsSpec(2, 1, 32, VOCAB)), tmp_path / "medusa", "org/tiny", base_model=target)
    with pytest.raises(FileNotFoundError, match=r"re-export the drafter with export_vllm=true"):
        export_eagle3_gguf(medusa, tmp_path)
    spec = new_spec("eagle3", {}, target.config, num_heads=2, num_layers=1, hidden_size=32, vocab_size=VOCAB)
    eagle3 = save_export(Eagle3Drafter(spec), tmp_path / "eagle3", "org/tiny", base_model=target)
    assert speculators_files(eagle3)[1]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with pytest.raises(ValueError, match="outtype='q4_0': choose one of"):
        export_eagle3_gguf(eagle3, tmp_path, outtype="q4_0")
    with pytest.raises(FileNotFoundError, match="no config.json"):  # checked before llama.cpp is looked for
        export_eagle3_gguf(eagle3, tmp_path / "no-target")
    config = eagle3 / "speculators" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "eagle_aux_hidden_state_layer_ids": [2, 5]}))
    with pytest.raises(ValueError, match=r"\[2, 5\]: llama.cpp's EAGLE-3 reads exactly 3 target layers"):
        export_eagle3_gguf(eagle3, tmp_path)
    assert not drafter_gguf_path(eagle3).exists()  # nothing written by a refusal


# ---------------------------------------------------------------- the real llama.cpp

llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama.cpp is not installed: run `bash "
                              "launch/install_llamacpp.sh`")


def test_conversion_is_recorded_skipped_when_current_and_atomic(monkeypatch, tmp_path):
    """With a stand-in converter (writes its arguments to --outfile, or fails on request): the GGUF appears whole,
    with its record; a second call with the same speculators files and outtype converts nothing; another outtype or
    changed weights convert again; a failing converter leaves the previous file and names its output."""
    import sys

    import medusa_train.drafters.eagle3.gguf as gguf_export

    script = tmp_path / "convert.py"
    script.write_text("import json, os, sys\nargs = sys.argv[1:]\nif os.environ.get('FAIL'):\n"
                      "    print('boom: unknown tensor'); sys.exit(3)\n"
                      "open(args[args.index('--outfile') + 1], 'w').write(json.dumps(args))\n")
    monkeypatch.setattr(gguf_export, "converter_command", lambda: [sys.executable, str(script)])
    target = make_tiny_model(num_hidden_layers=8)
    spec = new_spec("eagle3", {}, target.config, num_heads=2, num_layers=1, hidden_size=32, vocab_size=VOCAB)
    export = save_export(Eagle3Drafter(spec), tmp_path / "eagle3", "org/tiny", base_model=target)
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    out = export_eagle3_gguf(export, folder)
    assert out == drafter_gguf_path(export) and json.loads(out.read_text())[:3] == [
        str(export / "speculators"), "--target-model-dir", str(folder)]
    record = json.loads((out.parent / "eagle3_drafter.json").read_text())
    assert record["outtype"] == "f32" and len(record["speculators_sha256"]) == 64
    out.write_text("kept")
    assert export_eagle3_gguf(export, folder).read_text() == "kept"  # current: not converted again
    assert "f16" in json.loads(export_eagle3_gguf(export, folder, outtype="f16").read_text())
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(RuntimeError, match=r"converter failed .*exit 3.*\n.*boom: unknown tensor"):
        export_eagle3_gguf(export, folder, force=True)
    assert "f16" in out.read_text() and sorted(p.name for p in out.parent.iterdir()) == [
        "eagle3_drafter.gguf", "eagle3_drafter.json"]  # the previous file, no temporary left


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if "--fail" in open(args[args.index("-m") + 1]).read():
    print("error: failed to load model"); sys.exit(1)
print("build: 11434 (abc1234) with a stand-in", flush=True)
draft = "-md" in args
counts = {"drafts": 0, "accepted": 0, "draft_tokens": 0, "pos": [0, 0]}
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, body, kind="application/json"):
        data = body.encode()
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            return self.answer("{}")
        lines = [f"llamacpp:spec_decode_num_drafts_total {counts['drafts']}",
                 f"llamacpp:spec_decode_num_accepted_tokens_total {counts['accepted']}",
                 f"llamacpp:spec_decode_num_draft_tokens_total {counts['draft_tokens']}"]
        lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}'
                  for i, n in enumerate(counts["pos"])]
        self.answer("\\n".join(lines) + "\\n", "text/plain")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert (req["temperature"], req["top_k"], req["cache_prompt"], req["return_tokens"]) == (0, 1, False, True)
        tokens = [req["prompt"][-1] + 1 + i for i in range(req["n_predict"])]
        if draft:  # two chains: 2 and 1 drafts accepted
            counts.update(drafts=counts["drafts"] + 2, accepted=counts["accepted"] + 3,
                          draft_tokens=counts["draft_tokens"] + 4, pos=[counts["pos"][0] + 2, counts["pos"][1] + 1])
        self.answer(json.dumps({"tokens": tokens, "stop_type": "limit", "timings": {"prompt_ms": 12.0}}))
HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def test_the_server_starts_answers_pauses_and_stops(monkeypatch, tmp_path):
    """LlamaServer over a stand-in llama-server (the same command line, endpoints and counters): the request is
    greedy from an empty cache (else the stand-in drops the connection), the counters' difference is the request's, the process is stopped between requests
    and gone after close; a server that exits while loading is reported with its log."""
    import os
    import sys
    import time
    from contextlib import closing

    from inference.engines.llamacpp_server import LlamaCppError, LlamaServer

    bin_dir = tmp_path / "llamacpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "llamacpp" / ".medusa-llamacpp-installed").write_text("x")
    server = bin_dir / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", str(tmp_path / "llamacpp"))
    target, drafter = tmp_path / "target.gguf", tmp_path / "drafter.gguf"
    target.write_text("ok")
    drafter.write_text("ok")
    with closing(LlamaServer(target, drafter, draft_max=2, threads=2, pause_when_idle=True,
                             spec_type="draft-eagle3")) as llama:
        assert llama.info["version"] == "b11434 (abc1234)"
        assert llama.command[llama.command.index("--spec-type") + 1] == "draft-eagle3"
        assert [llama.command[llama.command.index(f) + 1] for f in ("-t", "-tb", "-td", "-tbd")] == ["2"] * 4
        time.sleep(0.2)
        assert open(f"/proc/{llama._proc.pid}/stat").read().split()[2] == "T"  # stopped while idle
        for _ in range(2):  # the second request's counters are its own, not the sum
            reply = llama.complete([5, 6], 4)
            assert reply["tokens"] == [7, 8, 9, 10] and reply["spec"] == {
                "num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]}
        pid = llama._proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    decoder = LlamaCppDecoder(LlamaServer(target, threads=1), "llamacpp", ctx_size=64)
    result = decoder.generate([5], DecodeConfig(max_new_tokens=3))
    assert result.tokens == [6, 7, 8] and result.accepted_lengths == [1, 1] and result.prefill_time_s == 0.012
    decoder.close()
    target.write_text("--fail")
    with pytest.raises(LlamaCppError, match=r"exited with status 1 while starting:\n.*failed to load model"):
        LlamaServer(target, threads=1)


def eagle3_export(model, folder):
    """A random EAGLE-3 drafter for ``model`` (vLLM's default taps, a 4,096-token draft vocabulary, K = 3) exported
    with ``speculators/``."""
    from tests.inference.test_vllm_eagle3 import eagle3_drafter

    return save_export(eagle3_drafter(model), folder, "HuggingFaceTB/SmolLM2-135M-Instruct", base_model=model)


@llamacpp
@pytest.mark.slow
def test_llamacpp_drafts_with_our_converted_drafter_and_keeps_plain_replies(smollm2, tmp_path):
    """llama.cpp's converter turns a random EAGLE-3 export into a GGUF its llama-server loads beside SmolLM2's; the
    server drafts with it (draft tokens counted, chains of at most K = 3), its greedy replies equal plain
    llama.cpp's, and the pass lengths rebuilt from its counters add up to each reply."""
    from medusa_train.loading.base import engine_model_path, load_base_model
    from medusa_train.chat.prompts import encode_prompt, load_prompts
    from inference.engines.llamacpp_server import LlamaServer

    model, tokenizer = load_base_model(smollm2)
    export = eagle3_export(model, tmp_path / "eagle3")
    drafter = export_eagle3_gguf(export, engine_model_path(smollm2))
    target = f"{smollm2.name_or_path}/{smollm2.gguf_file}"
    prompts = [encode_prompt(tokenizer, p.first_turn_messages()) for p in load_prompts("mt_bench", num_prompts=2)]
    with closing(LlamaServer(target, threads=2)) as plain, \
            closing(LlamaServer(target, drafter, draft_max=3, threads=2, pause_when_idle=True,
                                spec_type="draft-eagle3")) as eagle3:
        for ids in prompts:
            reference = plain.complete(ids, 24, ignore_eos=True)
            served = eagle3.complete(ids, 24, ignore_eos=True)
            assert served["tokens"] == reference["tokens"] and len(served["tokens"]) == 24
            spec = served["spec"]
            assert spec["num_draft_tokens"] > 0 and 0 < spec["num_drafts"] <= 23
            assert spec["num_draft_tokens"] <= 3 * spec["num_drafts"] and len(spec["accepted_per_pos"]) <= 3
            assert sum(pass_lengths(24, spec)) == 23
            assert reference["spec"]["num_drafts"] == 0


@llamacpp
@pytest.mark.slow
def test_medusa_eval_runs_the_llamacpp_rows(smollm2, tmp_path):
    """``medusa-eval decoders=[vanilla,llamacpp,llamacpp_eagle3]`` on two MT-Bench first turns: the drafter is
    converted into the export, both rows are written, the EAGLE-3 row's replies equal plain llama.cpp's and its τ
    is at least 1; the run record names the engine and the threads."""
    from hydra import compose, initialize_config_dir

    from inference.cli.evaluate import register_schemas
    from inference.evaluation.eval_run import evaluate
    from inference.evaluation.results import read_rows
    from medusa_train.loading.base import load_base_model
    from inference.conf import CONF_DIR

    register_schemas()
    model, _ = load_base_model(smollm2)
    export = eagle3_export(model, tmp_path / "eagle3")
    overrides = ["model=smollm2_135m", f"export_dir={export}", f"output_dir={tmp_path / 'eval'}", "prompts=mt_bench",
                 "num_prompts=2", "max_turns=1", "max_new_tokens=16", "dtype=float32",
                 "decoders=[vanilla,llamacpp,llamacpp_eagle3]"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    evaluate(cfg)
    assert drafter_gguf_path(export).is_file()
    rows = {(r["prompt_id"], r["decoder"]): r for r in read_rows(tmp_path / "eval" / "results.jsonl")}
    for pid in {p for p, _ in rows}:
        plain, eagle3 = rows[(pid, "llamacpp")], rows[(pid, "llamacpp_eagle3")]
        assert eagle3["tokens"] == plain["tokens"] and plain["new_tokens"] == len(plain["tokens"]) > 0
        assert eagle3["mean_accepted_tokens"] is None or eagle3["mean_accepted_tokens"] >= 1.0
        assert sum(eagle3["accepted_lengths"]) == eagle3["new_tokens"] - 1
