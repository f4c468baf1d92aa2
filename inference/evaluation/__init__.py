"""``medusa-eval``: decoders side by side over a prompt set, interleaved and resumable.

- :mod:`~inference.evaluation.eval_config`: the settings (``conf/evaluate.yaml``, ``conf/decoder/*.yaml``).
- :mod:`~inference.evaluation.runner`: every decoder on every prompt and turn -> ``results.jsonl`` rows.
- :mod:`~inference.evaluation.results`: the rows file, appended row by row and resumed.
- :mod:`~inference.evaluation.provenance`: what the rows were measured with, compared on resume.
- :mod:`~inference.evaluation.summary`: ``summary.json`` (the fields :func:`~inference.evaluation.summary.summarize` documents) and ``summary.md``.
- :mod:`~inference.evaluation.plots`: PNG plots.
- :mod:`~inference.evaluation.environment`: device, dtype, threads, versions, git commit of a run.
- :mod:`~inference.evaluation.sweep`: many runs (a Hydra multirun) in one table.
- :mod:`~inference.evaluation.eval_run`: the whole run, as the command line does it.
"""
