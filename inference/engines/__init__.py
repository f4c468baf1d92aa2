"""Engines the decoders drive from outside this environment: llama.cpp's server (:mod:`.llamacpp_server`); vLLM
and the OpenAI-compatible client sit below both packages (:mod:`medusa_train.engines`)."""
