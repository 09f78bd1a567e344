from tasks.stage_task import stage_task

# Judging may call remote endpoints (LLM judges, HTTP scorers): retry transient failures.
judge_task = stage_task("judge", retries=1, retry_delay_seconds=10)
