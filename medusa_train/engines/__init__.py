"""Engines outside this environment, below training and decoding alike: vLLM, run in its own environment as a
subprocess (:mod:`.vllm_env`, :mod:`.vllm_worker`), and the client of an OpenAI-compatible server
(:mod:`.openai_client`). Self-distillation (:mod:`medusa_train.data.distill_engines`) and the decoders that wrap
them (:mod:`inference.decoders.vllm`, :mod:`inference.engines.llamacpp_server`) start and call them."""
