"""Memory planning: what each stage of a run needs per GPU and per host, computed before anything loads, from the
target's ``config.json`` and the drafter's settings built on the ``meta`` device (issue 37, ``docs/scale.md``).

- :mod:`.terms`: a named number of bytes, a stage, the plan (:class:`MemoryPlan`, with its table and JSON);
- :mod:`.meta`: the target and the drafter on ``meta``, their exact parameter counts;
- :mod:`.settings`: the machine and the run planned for (:class:`PlanSettings`);
- :mod:`.stages`: the terms of self-distillation, the cache build, training and export;
- :mod:`.plan`: the plan of a run and the fewest changes that make it fit;
- :mod:`.presets`: the shipped heads and trainer presets as checked configs;
- :mod:`.run_check`: the check ``medusa-train`` runs before it loads the base.

Planned from shapes, not measured on a GPU.
"""

from medusa_train.planning.meta import HeadsSizes, TargetSizes, heads_sizes, load_target_config, target_sizes
from medusa_train.planning.plan import Fix, build_plan, find_fix, plan_from_sizes
from medusa_train.planning.presets import heads_preset, trainer_preset
from medusa_train.planning.settings import PlanSettings, settings_from_config, zero_stage_of
from medusa_train.planning.terms import GIB, MemoryPlan, Stage, Term, gib

__all__ = ["GIB", "Fix", "HeadsSizes", "MemoryPlan", "PlanSettings", "Stage", "TargetSizes", "Term", "build_plan",
           "find_fix", "gib", "heads_preset", "heads_sizes", "load_target_config", "plan_from_sizes",
           "settings_from_config", "target_sizes", "trainer_preset", "zero_stage_of"]
