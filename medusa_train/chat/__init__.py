"""Chats and prompts, shared by training and evaluation: conversations read from their sources
(:mod:`.conversations`), the chat template and its rendering (:mod:`.templates`), and the prompt sets tuning and
evaluation run (:mod:`.prompts`)."""
