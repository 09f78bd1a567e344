"""Stage runners: one module per stage kind, each `run(ctx: StageContext) -> StageResult`.

They adapt a stage config + upstream outputs into calls of the library (trainers, engines, judges,
hub). They run inside the stage process (`python -m alignpipe.stage`), never in the flow process.
"""

import importlib

KINDS = ("format", "sft", "reward", "dpo", "kto", "grpo", "rloo", "ppo", "online_dpo", "judge", "push")


def runner(kind: str):
    if kind not in KINDS:
        raise KeyError(f"no runner for stage kind {kind!r}")
    return importlib.import_module(f"alignpipe.stages.{kind}").run
