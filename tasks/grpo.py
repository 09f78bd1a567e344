from tasks.stage_task import stage_task

grpo_task = stage_task("grpo")
