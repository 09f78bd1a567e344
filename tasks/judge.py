from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.stage_task import stage_task


def publish_artifacts(manifest) -> None:
    """The win rates as a Prefect table artifact and the judge's report as a markdown artifact."""
    key = "".join(ch if ch.isalnum() else "-" for ch in manifest.stage_id.lower())
    rows = [{k: w[k] for k in ("candidate", "baseline", "win_rate", "ci_low", "ci_high", "wins", "ties", "losses")}
            for w in manifest.info.get("win_rates", [])]
    create_table_artifact(table=rows, key=f"{key}-win-rates", description=f"win rates of judge stage {manifest.stage_id}")
    create_markdown_artifact(markdown=manifest.info.get("report", ""), key=f"{key}-report",
                             description=f"report of judge stage {manifest.stage_id}")


# Judging may call remote endpoints (LLM judges, HTTP scorers): retry transient failures.
judge_task = stage_task("judge", retries=1, retry_delay_seconds=10, on_done=publish_artifacts)
