from tasks.stage_task import stage_task

reward_task = stage_task("reward")
