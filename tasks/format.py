from tasks.stage_task import stage_task

format_task = stage_task("format")
