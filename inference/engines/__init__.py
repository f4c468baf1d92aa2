"""Engines outside this environment: vLLM, run in its own environment as a subprocess (:mod:`.vllm_env`)."""
