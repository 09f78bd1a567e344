from tasks.stage_task import stage_task


def hub_token_env(spec) -> dict[str, str]:
    """HF_TOKEN for the push process from the stage's Prefect Secret block, if it names one."""
    from prefect.blocks.system import Secret

    stage = next(s for s in spec.recipe["stages"] if s["id"] == spec.stage_id)
    name = stage.get("token_secret")
    return {"HF_TOKEN": Secret.load(name).get()} if name else {}


# Hub uploads fail transiently; the stage is idempotent (manifest last), so a retry is safe.
push_task = stage_task("push", retries=2, retry_delay_seconds=[5, 30], env_fn=hub_token_env)
