"""Self-distillation's vLLM engines on a node: which rank starts one, on which GPUs (a pure function), and that the
worker's environment and start request carry them. No GPU is needed (the worker's spawn is mocked); the GPU path is
planned, not run here."""

from __future__ import annotations

import pytest

from medusa_train.config.schema import DataConfig, ModelConfig
from medusa_train.data.distill_engines import EnginePlacement, distill_engine, engine_placement
from tests.medusa_train.test_distill_engines import fake_vllm


@pytest.mark.parametrize("rank, local_rank, world, gpus, tp, visible, expected", [
    (3, 3, 4, 0, 1, None, EnginePlacement(True, None, 3, 4, 1)),  # CPU: every rank its engine, as before
    (3, 3, 8, 8, 1, None, EnginePlacement(True, "3", 3, 8, 1)),  # one engine per GPU
    (2, 2, 8, 8, 2, None, EnginePlacement(True, "2,3", 1, 4, 2)),  # a pair's first rank starts it
    (3, 3, 8, 8, 2, None, EnginePlacement(False, "2,3", 1, 4, 2)),  # ... the second waits
    (12, 4, 16, 8, 4, None, EnginePlacement(True, "4,5,6,7", 3, 4, 4)),  # second node, second group of four
    (1, 1, 4, 4, 2, "4,5,6,7", EnginePlacement(False, "4,5", 0, 2, 2)),  # indices into the job's own GPUs
])
def test_engine_placement(rank, local_rank, world, gpus, tp, visible, expected):
    assert engine_placement(rank, local_rank, world, gpus, tp, visible) == expected


def test_every_conversation_has_one_engine():
    """16 ranks on two 8-GPU nodes with tp=2: 8 engines, shares 0..7 each started once."""
    places = [engine_placement(r, r % 8, 16, 8, 2) for r in range(16)]
    assert sorted(p.engine_rank for p in places if p.launches) == list(range(8))
    assert {p.engines for p in places} == {8}


@pytest.mark.parametrize("args, message", [
    ((0, 0, 8, 8, 3), "must divide the GPUs of a node \\(8\\)"),
    ((0, 0, 6, 8, 4), "and the number of ranks \\(6\\)"),
    ((0, 0, 2, 0, 2), "needs GPUs"),
    ((8, 8, 16, 8, 1), "local rank 8 has no GPU"),
])
def test_bad_tensor_parallel_size_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        engine_placement(*args)


def test_tensor_parallel_size_is_for_vllm():
    with pytest.raises(ValueError, match="self_distill_tensor_parallel_size is for data.self_distill_engine=vllm"):
        DataConfig(self_distill=True, self_distill_tensor_parallel_size=2).validate()
    DataConfig(self_distill=True, self_distill_engine="vllm", self_distill_tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="self_distill_gpu_memory_utilization"):
        DataConfig(self_distill_gpu_memory_utilization=0.0).validate()


def test_worker_environment_and_start_request_carry_the_gpus(monkeypatch, tmp_path):
    """VllmWorker's subprocess gets CUDA_VISIBLE_DEVICES; its start request, tensor_parallel_size and the memory
    share (the spawn is mocked: nothing starts)."""
    import medusa_train.engines.vllm_env as vllm_env

    spawned, requests = [], []

    class Proc:
        pid = 12345

        def poll(self):
            return None

    def popen(cmd, **kwargs):
        spawned.append(kwargs["env"])
        return Proc()

    monkeypatch.setattr(vllm_env, "vllm_python", lambda: tmp_path / "bin" / "python")
    monkeypatch.setattr(vllm_env.subprocess, "Popen", popen)
    monkeypatch.setattr(vllm_env.VllmWorker, "request", lambda self, op, **f: requests.append((op, f)) or {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    vllm_env.VllmWorker("model", cuda_visible_devices="2,3", tensor_parallel_size=2, gpu_memory_utilization=0.9,
                        log_path=tmp_path / "w.log")
    assert spawned[0]["CUDA_VISIBLE_DEVICES"] == "2,3"
    op, fields = requests[0]
    assert op == "start" and fields["tensor_parallel_size"] == 2 and fields["gpu_memory_utilization"] == 0.9
    vllm_env.VllmWorker("model", log_path=tmp_path / "w.log")  # on the CPU: the environment's devices as they are
    assert spawned[1]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and requests[1][1]["tensor_parallel_size"] == 1


def test_distill_engine_starts_vllm_on_its_gpus(monkeypatch):
    """With CUDA (faked), the engine gets the placement's GPUs, tensor parallelism and data's memory share."""
    import types

    import torch

    started = []

    class Worker:
        vllm_version, log_path = "fake", "fake.log"

        def __init__(self, path, **kwargs):
            started.append(kwargs)

        def generate(self, prompts, max_new_tokens, stop_ids):
            return {"outputs": [{"token_ids": [5], "finish_reason": "stop"} for _ in prompts]}

        def close(self):
            pass

    fake_vllm(monkeypatch, Worker)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    data = DataConfig(self_distill_engine="vllm", self_distill_tensor_parallel_size=2)
    place = engine_placement(2, 2, 8, 8, 2)
    model = types.SimpleNamespace(dtype=torch.bfloat16)
    with distill_engine(data, model, None, ModelConfig(name_or_path="model"), 100, place) as (generate, _):
        assert generate([[1, 2]], 4, {5}) == [([5], True)]
    assert started[0]["cuda_visible_devices"] == "2,3" and started[0]["tensor_parallel_size"] == 2
    assert started[0]["gpu_memory_utilization"] == 0.9 and started[0]["enforce_eager"] is False


@pytest.mark.parametrize("engine, order", [("server", ["data", "base"]), ("hf", ["base", "data"])])
def test_self_distillation_by_another_engine_runs_before_the_base_loads(engine, order, tmp_path, monkeypatch):
    """vLLM or a server writes the replies while the training base is not loaded (it would hold the GPU the engines
    need); they get a stand-in with the base's config and dtype. HF generate needs the base, so it loads first."""
    import contextlib
    import types

    import torch

    import medusa_train.training.base_recipe as base_recipe
    from tests.medusa_train.test_training import tiny_overrides, write_tiny_inputs, compose_train

    model_dir, data = write_tiny_inputs(tmp_path)
    extra = {"data.self_distill": "true", "data.self_distill_engine": engine, "data.max_new_tokens": 8}
    if engine == "server":
        extra["data.server_url"] = "http://127.0.0.1:9"
    recipe = base_recipe.BaseRecipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "out", **extra)))
    recipe.device, recipe.barrier = torch.device("cpu"), lambda: None
    events, models = [], []

    def prepare_data(data, *, model, **kwargs):
        events.append("data")
        models.append(model)

    real_load = base_recipe.BaseRecipe.load_base
    monkeypatch.setattr(base_recipe, "prepare_data", prepare_data)
    monkeypatch.setattr(base_recipe, "check_enough_data", lambda *a: None)
    monkeypatch.setattr(base_recipe.BaseRecipe, "load_base",
                        lambda self, args: events.append("base") or real_load(self, args))
    args = types.SimpleNamespace(main_process_first=lambda desc: contextlib.nullcontext(), deepspeed=None)
    recipe.load_base_and_data(args)
    assert events == order
    if engine == "server":
        assert models[0].config.vocab_size == 512 and models[0].dtype == torch.float32  # no weights, no base
    else:
        assert models[0] is recipe.base
