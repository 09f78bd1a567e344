from tasks.stage_task import stage_task

ppo_task = stage_task("ppo")
