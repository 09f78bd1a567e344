from tasks.stage_task import stage_task

dpo_task = stage_task("dpo")
