"""Pick the generation engine a rollout spec asks for."""

from __future__ import annotations

from pathlib import Path


def hf_engine(spec, model, tokenizer):
    """The hf engine on `model` itself (a trainer's policy), with `spec`'s hf options."""
    from alignpipe.engine.hf import HFEngine

    return HFEngine(
        model,
        tokenizer,
        spec.batch_size,
        static_cache=spec.static_cache,
        compile=spec.compile,
        cuda_graphs=spec.cuda_graphs,
    )


def make_engine(spec, model, tokenizer, window: int | None = None, scratch: Path | None = None):
    """An engine for `spec` (a `RolloutSpec`) generating from `model`'s weights; a vLLM colocate engine sized for
    sequences of `spec.max_model_len` tokens, else `window` (None: the model's whole context); a server engine
    syncing an adapter saves it to `spec.adapter_dir`, else to `scratch/rollout-adapter` (the stage's folder)."""
    if spec.backend == "hf":
        return hf_engine(spec, model, tokenizer)
    if spec.mode == "server":
        from alignpipe.engine.vllm import VLLMServerEngine
        from alignpipe.judges.http_endpoints import endpoint_api_key

        folder = spec.adapter_dir or (scratch / "rollout-adapter" if scratch is not None else None)
        key = endpoint_api_key(spec.api_key_env, "rollout.api_key_env")
        return VLLMServerEngine(
            spec.server_url,
            tokenizer,
            sync=spec.sync,
            adapter_dir=folder,
            api_key=key,
            logprobs_mode=spec.logprobs_mode,
        )
    from alignpipe.engine.vllm import VLLMColocateEngine

    return VLLMColocateEngine(
        model,
        tokenizer,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        sleep_between_rollouts=spec.sleep_between_rollouts,
        max_model_len=spec.max_model_len or window,
    )
