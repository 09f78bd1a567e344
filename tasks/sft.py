from tasks.stage_task import stage_task

sft_task = stage_task("sft")
