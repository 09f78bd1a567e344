"""`alignpipe` command line: validate, show, run, resume, deploy, make-tiny."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from alignpipe.recipe import RecipeError, load_recipe

PIPELINE_POOL = "alignpipe-process"  # `alignpipe deploy`'s default pool for the pipeline flow (infra/README.md)


def _set_arg(p: argparse.ArgumentParser, what: str = "a recipe field") -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {what}, e.g. --set stages.sft.max_steps=50 (repeatable)",
    )


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path of a YAML recipe")
    _set_arg(p)


def cmd_validate(args) -> int:
    from alignpipe.summary import dag_text

    recipe = load_recipe(args.recipe, args.overrides, to_run=True)
    from flows.preflight import check_prefect, needs_prefect

    if needs_prefect(recipe):  # the work pools and Secret blocks it names, asked of the Prefect server as `run` asks
        check_prefect(recipe, str(args.recipe))
    print(f"ok: {args.recipe} is valid")
    print(dag_text(recipe))
    return 0


def cmd_show(args) -> int:
    from alignpipe.plan import plan
    from alignpipe.summary import dag_text

    if args.schema:
        from alignpipe.recipe.schema import Recipe

        print(json.dumps(Recipe.model_json_schema(), indent=1))
        return 0
    if not args.recipe:
        print("error: show needs a RECIPE (or --schema for the recipe JSON schema)", file=sys.stderr)
        return 2
    recipe = load_recipe(args.recipe, args.overrides)
    print(dag_text(recipe, plan(recipe)))
    return 0


def cmd_run(args) -> int:
    from rich.console import Console

    from alignpipe.summary import print_summary

    recipe = load_recipe(args.recipe, args.overrides, to_run=True)  # exit 2 before anything is written
    unknown = [f for f in args.force if f not in {s.id for s in recipe.stages}]
    if unknown:
        from alignpipe.recipe.errors import Problem

        raise RecipeError(
            [
                Problem(
                    ("--force",),
                    f"no stage {f!r} in this recipe",
                    f"use one of: {', '.join(s.id for s in recipe.stages)}",
                )
                for f in unknown
            ],
            f"alignpipe run {args.recipe}",
        )
    from flows.pipeline import pipeline, warm_stage_host
    from flows.preflight import check_prefect, needs_prefect

    if needs_prefect(recipe):
        check_prefect(recipe, str(args.recipe))  # a pool or Secret block the server lacks: exit 2 before a flow run
    warm_stage_host(recipe)  # its imports run while Prefect's server starts
    state = pipeline(recipe_path=str(args.recipe), overrides=args.overrides, force=args.force, return_state=True)
    run_id = str(state.state_details.flow_run_id)
    summary_path = recipe.run_root / "runs" / f"{run_id}.json"
    console = Console(width=None if Console().is_terminal else 160)
    if summary_path.exists():
        print_summary(json.loads(summary_path.read_text()), console)
    if not state.is_completed():
        console.print(f"[bold red]pipeline failed[/]: {state.message}")
        return 1
    return 0


def cmd_resume(args) -> int:
    """Re-run the pipeline run RUN_ID's recipe with its overrides: finished stages are reused, a killed
    stage continues from its last checkpoint. The run's summary is looked up in the local workdir, then in
    `--storage` (where a storage-backed run left it); a recipe file missing on this machine is rebuilt from
    the text the run recorded."""
    found = find_run_summary(args.run_id, args.workdir, args.storage)
    if found is None:
        where = f"{args.workdir} (*/runs/<id>.json)" + (
            f" or {args.storage} (*/runs/<id>.json)" if args.storage else ""
        )
        hint = "" if args.storage else "; a run with `storage:` in its recipe: pass --storage URL"
        print(f"error: no pipeline run {args.run_id!r} under {where}{hint}", file=sys.stderr)
        return 2
    summary, source = found
    request = summary.get("request") or {}
    recipe_path, text = request.get("recipe"), request.get("recipe_text")
    if recipe_path and Path(recipe_path).is_file():
        if text is not None and Path(recipe_path).read_text() != text:
            print(
                f"note: {recipe_path} changed since run {summary['pipeline_run_id']}; resuming with the file as it is now"
            )
    elif text:
        from alignpipe.recipe.load import parse_recipe

        root = parse_recipe(text, request.get("overrides") or [], source=source, check_files=False).run_root
        copy = root / "runs" / f"{summary['pipeline_run_id']}.recipe.yaml"
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(text)
        print(
            f"{recipe_path or 'the recipe'} is not on this machine: resuming with the recipe the run recorded ({copy})"
        )
        recipe_path = str(copy)
    else:
        print(
            f"error: run {args.run_id} ({source}) did not record its recipe, and {recipe_path!r} is not here; run "
            "`alignpipe run RECIPE` again",
            file=sys.stderr,
        )
        return 2
    print(f"resuming {summary['pipeline']} from {recipe_path} with {request.get('overrides') or 'no overrides'}")
    return cmd_run(argparse.Namespace(recipe=recipe_path, overrides=request.get("overrides") or [], force=[]))


def find_run_summary(run_id: str, workdir: str, storage: str | None = None) -> tuple[dict, str] | None:
    """(summary, where it was found) of the pipeline run whose id starts with `run_id`: the newest match in
    `<workdir>/*/runs/`, else in `<storage>/*/runs/`."""
    local = sorted(Path(workdir).expanduser().glob(f"*/runs/{run_id}*.json"), key=lambda p: p.stat().st_mtime)
    if local:
        return json.loads(local[-1].read_text()), str(local[-1])
    if not storage:
        return None
    import fsspec

    fs, root = fsspec.core.url_to_fs(storage)
    matches = sorted(fs.glob(f"{root.rstrip('/')}/*/runs/{run_id}*.json"))
    if not matches:
        return None
    return json.loads(fs.cat_file(matches[-1])), f"{fs.unstrip_protocol(matches[-1])}"


def cmd_deploy(args) -> int:
    """Deploy the single-stage flow on each work pool (and, with --recipe, the pipeline flow for it)."""
    usage = deploy_usage_problems(args)
    if usage:  # before Prefect is imported or its server asked anything (a temporary one would start for nothing)
        print("error: nothing was deployed:\n" + "\n".join(f"  - {p}" for p in usage), file=sys.stderr)
        return 2
    from flows.deploy import deploy_pipeline, deploy_problems, deploy_stage_flow
    from tasks.dispatch import STAGE_FLOW

    recipe = load_recipe(args.recipe, args.overrides) if args.recipe else None  # a bad one fails before any deploy
    pipeline_pool = args.pipeline_pool or PIPELINE_POOL
    problems = deploy_problems(args.pool + ([pipeline_pool] if args.recipe else []), args.cron)
    if problems:
        print("error: nothing was deployed:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    if recipe is not None:  # its stages' pools and Secret blocks: a scheduled run would fail at its start otherwise
        from flows.preflight import check_prefect

        check_prefect(recipe, str(args.recipe), deploying=tuple(args.pool))
    for pool in args.pool:
        deploy_stage_flow(pool)
        print(f"deployed {STAGE_FLOW}/{pool} on work pool {pool!r}")
    if recipe is not None:
        name = args.name or recipe.name
        deploy_pipeline(args.recipe, name, pipeline_pool, args.overrides, args.cron)
        print(
            f"deployed alignpipe-pipeline/{name} on work pool {pipeline_pool!r}"
            + (f" (cron {args.cron})" if args.cron else "")
        )
    return 0


def deploy_usage_problems(args) -> list[str]:
    """What `alignpipe deploy`'s arguments ask that it cannot do: nothing to deploy, or pipeline options (`--cron`,
    `--name`, `--set`, `--pipeline-pool`) without the `--recipe` they belong to, which would be dropped unseen."""
    problems = []
    if not args.pool and not args.recipe:
        problems.append(
            "nothing to deploy: pass --pool POOL (the stage flow that pool's workers run; repeatable) and/or "
            "--recipe RECIPE (the pipeline flow, scheduled with --cron)"
        )
    if not args.recipe:
        given = {"--cron": args.cron, "--name": args.name, "--set": args.overrides or None}
        given["--pipeline-pool"] = args.pipeline_pool
        problems += [
            f"{flag} belongs to the pipeline deployment, which only --recipe RECIPE makes; add --recipe, or leave "
            f"{flag} out"
            for flag, value in given.items()
            if value is not None
        ]
    return problems


def cmd_make_tiny(args) -> int:
    from alignpipe.tiny import make_tiny

    out = make_tiny(args.dir, seed=args.seed, force=args.force)
    print(f"tiny assets in {out}: model/ (tokenizer + Llama), data/*.jsonl")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignpipe", description="Declarative RLHF pipelines on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a recipe; exit 2 with every problem listed if invalid")
    _recipe_args(p)
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("show", help="print the stage DAG, which stages are cached and where their outputs are")
    p.add_argument("recipe", nargs="?", help="path of a YAML recipe (not with --schema)")
    _set_arg(p)
    p.add_argument("--schema", action="store_true", help="print the recipe JSON schema instead")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("run", help="run a recipe as a Prefect flow")
    _recipe_args(p)
    p.add_argument("--force", action="append", default=[], metavar="STAGE", help="re-run this stage even if cached")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser(
        "resume", help="run a pipeline run's recipe again: finished stages are reused, killed ones resume"
    )
    p.add_argument("run_id", help="the pipeline (flow) run id, or a prefix of it")
    p.add_argument("--workdir", default="./runs", help="the recipe's workdir (default ./runs)")
    p.add_argument(
        "--storage",
        help="the recipe's storage URL (s3://…, gs://…): find the run there when this machine's "
        "workdir does not have it; credentials come from the environment, as for `storage:`",
    )
    p.set_defaults(fn=cmd_resume)
    p = sub.add_parser(
        "deploy", help="deploy the stage flow on work pools and/or a recipe's pipeline (with a schedule)"
    )
    p.add_argument(
        "--pool", action="append", default=[], help="work pool to deploy the single-stage flow on (repeatable)"
    )
    p.add_argument("--recipe", help="also deploy the pipeline flow for this recipe")
    _set_arg(p, "a field of --recipe in every run of the deployment")
    p.add_argument("--name", help="pipeline deployment name (default: the recipe name; needs --recipe)")
    p.add_argument(
        "--pipeline-pool",
        help=f"work pool that runs the pipeline flow itself (default {PIPELINE_POOL}; needs --recipe)",
    )
    p.add_argument("--cron", help="schedule of the pipeline, e.g. '0 3 * * 1' for Mondays 03:00 (needs --recipe)")
    p.set_defaults(fn=cmd_deploy)
    p = sub.add_parser("make-tiny", help="write the tiny local model, tokenizer and synthetic datasets")
    p.add_argument("dir", type=Path, help="folder to write model/ and data/ into (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.set_defaults(fn=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    import os

    # Telemetry is turned off on importing alignpipe (alignpipe/__init__.py). Prefect's temporary server gets 20 s
    # to start by default; a busy machine (another run training) needs more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return RecipeError.exit_code
    except BrokenPipeError:  # `alignpipe show --schema | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:
        if (url := _unreachable_prefect(e)) is not None:
            print(
                f"error: the Prefect server at {url} (PREFECT_API_URL) cannot be reached: {e}\n"
                "  fix: start it (prefect server start) or point PREFECT_API_URL at a running one (`prefect config "
                "view` shows where it is set); without PREFECT_API_URL, alignpipe runs on a temporary local server",
                file=sys.stderr,
            )
            return 1
        if (refusal := _refused_by_prefect(e)) is not None:
            print(refusal, file=sys.stderr)
            return 1
        if "ephemeral Prefect API server" not in str(e):
            raise
        print(
            "error: Prefect's temporary server did not start in time "
            f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS')}).\n"
            "  fix: give it longer, e.g. PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=300 alignpipe run ...,\n"
            "       or run a server once and point every run at it:\n"
            "       prefect server start  (in another terminal), then export PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 1


def _unreachable_prefect(e: BaseException) -> str | None:
    """The configured Prefect API's URL where `e` says it did not answer (refused, timed out, no such host): the
    client's own connection errors, and the check a flow run makes first. None for anything else."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return None
    if isinstance(e, RuntimeError) and str(e).startswith("Failed to reach API at"):
        return url
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        with contextlib.suppress(RuntimeError):  # an error built without its request
            if str(e.request.url).startswith(url.rstrip("/")):
                return url
    return None


def _refused_by_prefect(e: BaseException) -> str | None:
    """The error and its fix where the configured Prefect API answered 401 or 403: a server started with
    PREFECT_SERVER_API_AUTH_STRING, or Prefect Cloud, that the client's credentials do not satisfy. The credentials
    themselves are never shown."""
    import httpx
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url or not isinstance(e, httpx.HTTPStatusError) or e.response.status_code not in (401, 403):
        return None
    if not str(e.request.url).startswith(url.rstrip("/")):
        return None
    if PREFECT_API_KEY.value():
        held, fix = (
            "the API key in PREFECT_API_KEY",
            "make a new key (`prefect cloud login`, or the Cloud UI's API keys) and set PREFECT_API_KEY to it",
        )
    elif PREFECT_API_AUTH_STRING.value():
        held, fix = (
            "the credentials in PREFECT_API_AUTH_STRING",
            "set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING (`user:password`)",
        )
    else:
        held, fix = (
            "a client with no credentials",
            "set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING (`user:password`), or "
            "PREFECT_API_KEY for Prefect Cloud, here and on every worker",
        )
    return (
        f"error: the Prefect server at {url} (PREFECT_API_URL) refused {held} ({e.response.status_code} "
        f"{e.response.reason_phrase})\n  fix: {fix}; `prefect config view` shows where each is set"
    )


if __name__ == "__main__":
    sys.exit(main())
