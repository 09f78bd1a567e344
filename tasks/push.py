from tasks.stage_task import stage_task

# Hub uploads fail transiently; the stage is idempotent (manifest last), so a retry is safe.
push_task = stage_task("push", retries=2, retry_delay_seconds=[5, 30])
