"""The `vllm` backend, in two modes behind the same `generate()` contract as `HFEngine`.

Written against vLLM's documented Python API for the range in the `vllm` extra (>=0.10,<0.34). vLLM
cannot be installed on CPU machines, so the colocate mode has not been run by this project's CI; the
server mode's HTTP path is tested against a loopback endpoint speaking the OpenAI completions API.

- `VLLMColocateEngine`: a vLLM `LLM` in the training process. `update_weights(model)` loads the policy's
  current weights into vLLM after each optimizer step; with `sleep_between_rollouts` vLLM sleeps
  (frees its KV cache and weights) while the trainer steps and wakes before generating. vLLM's engine runs in
  this process, not in the engine process vLLM starts by default (`distributed_executor_backend="external_launcher"`,
  as TRL's colocate mode): weights are handed to vLLM's model as tensors on the GPU, where a separate engine process
  would receive them pickled (a copy through host memory of every weight at every step, and refused by vLLM versions
  that do not allow pickled callables).
- `VLLMServerEngine`: completions from a running `vllm serve` (OpenAI-compatible `/v1/completions`).
  With `sync="adapter"` a LoRA policy follows training there: before each rollout `update_weights` saves the
  adapter to a folder the server reads and loads it under a new name through vLLM's runtime LoRA API
  (`/v1/load_lora_adapter`, in every vLLM the `vllm` extra allows; the previous one unloaded), and the completions ask for that name. The
  adapter is a few MB where full weights would be GBs, and this API is vLLM's documented one; pushing full weights
  into a server needs vLLM's NCCL weight-transfer engine in the trainer, which this project cannot run on a CPU.
  With `sync="none"` the served weights are what samples (a judge, or a run that reloads them itself). Token ids
  are the ones the server sampled where it returns them (vLLM's `return_token_ids`, since 0.10.2), else recovered
  by tokenizing the returned text; EOS is appended when `finish_reason == "stop"` and they do not end with it.
  A server started with `--logprobs-mode processed_logprobs` (`logprobs_mode="processed_logprobs"`) gives each sampled
  token's log-prob under its sampler's distribution (`token_logprobs`), which GRPO's sampling correction uses.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

from alignpipe.engine.base import FinishReason, Generation
from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.http_endpoints import answer_with_retries, auth_headers, json_with_retries, server_message
from alignpipe.special_tokens import stop_token_ids


class VLLMColocateEngine:
    copies_weights = True
    """`update_weights` loads every weight into vLLM: its time is the rollout's sync (`trainers.online.sync_weights`)."""

    def __init__(
        self,
        model,
        tokenizer,
        gpu_memory_utilization: float = 0.3,
        sleep_between_rollouts: bool = True,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
    ):
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the vllm extra
            raise ImportError(
                "rollout backend 'vllm' needs the vllm extra: pip install 'alignpipe[vllm]' (GPU only)"
            ) from e
        source = getattr(model.config, "_name_or_path", "")
        if not source or not Path(source).exists():
            source = tempfile.mkdtemp(prefix="alignpipe-vllm-")
            model.save_pretrained(source)
            tokenizer.save_pretrained(source)
        self.tok = tokenizer
        self.stops = stop_token_ids(tokenizer, model)
        self.sleep = sleep_between_rollouts
        # Sampling log-probs after temperature and the filters (what the sample was drawn from), for GRPO's
        # `sampling_correction`; a vLLM without the option returns the raw model's, which `generate` refuses to use.
        self.processed_logprobs = _has_engine_arg("logprobs_mode")
        extra: dict = {"logprobs_mode": "processed_logprobs"} if self.processed_logprobs else {}
        if max_model_len is not None:
            extra["max_model_len"] = max_model_len
        with launcher_environment():
            self.llm = LLM(
                model=source,
                gpu_memory_utilization=gpu_memory_utilization,
                dtype=dtype,
                seed=seed,
                enable_sleep_mode=sleep_between_rollouts,
                distributed_executor_backend="external_launcher",
                **extra,
            )
        self._asleep = False

    def _vllm_model(self):
        """vLLM's model, where its engine runs in this process (V0's engine, V1's under the external launcher: its
        `model_executor`, whose driver worker wraps the worker holding the model runner)."""
        engine = self.llm.llm_engine
        executor = getattr(engine, "model_executor", None)
        if executor is not None and hasattr(executor, "driver_worker"):
            worker = executor.driver_worker
            runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
            return runner.model
        return None

    def update_weights(self, model) -> None:
        """Copy the policy's weights into vLLM (a peft model's merged weights, computed without merging the live
        model: its adapter stays in training)."""
        from alignpipe.modeling import merged_state_dict

        if self._asleep:  # the weights first, the KV cache once they are loaded: less memory held while merging
            self.llm.wake_up(tags=["weights"])
        state = merged_state_dict(model)
        target = self._vllm_model()
        if target is not None:
            target.load_weights(state.items())
        else:  # a layout without the executor attribute: the same call through vLLM's RPC (in this process)
            self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(state.items()))
        state.clear()  # merged LoRA weights are copies: freed before the KV cache is allocated
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def generate(
        self,
        prompts,
        n: int = 1,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> list[Generation]:
        from vllm import SamplingParams as VSampling

        if logprobs and not self.processed_logprobs:
            raise RuntimeError(
                "sampling log-probs need a vLLM with the `logprobs_mode` engine argument (returning the log-probs of "
                "the distribution sampled from, after temperature and filters); upgrade vllm, or set "
                "sampling_correction: none"
            )
        sampling = sampling or SamplingParams()
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        params = VSampling(
            n=n,
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or -1,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            seed=seed,
            logprobs=0 if logprobs else None,  # 0: the sampled token's only
        )
        inputs = [{"prompt_token_ids": p} if not isinstance(p, str) else p for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        gens = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                ids = list(c.token_ids)
                logps = _sampled_logprobs(c, ids) if logprobs else None
                reason: FinishReason = "stop" if c.finish_reason == "stop" else "length"
                if reason == "stop" and (not ids or ids[-1] not in self.stops):  # a stop string, not a stop token
                    ids.append(self.tok.eos_token_id)
                    if logps is not None:
                        logps.append(math.nan)  # vLLM did not sample it
                gens.append(Generation(i, self.tok.decode(ids, skip_special_tokens=True), ids, reason, logps))
        if self.sleep:
            self.llm.sleep(level=1)
            self._asleep = True
        return gens


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What vLLM's external launcher reads to join (or make) the process group: `torchrun` and `accelerate launch` set
them for every rank of a multi-process stage."""


@contextlib.contextmanager
def launcher_environment():
    """The environment vLLM's external launcher needs while an `LLM` is built, and the process group it joins.

    A multi-process stage's ranks carry the launcher's variables; their process group is made here first if the
    trainer has not made it yet (the engine is built before the trainer's accelerator), so that vLLM joins the
    stage's group, as under TRL's colocate mode, rather than making one of its own. A single process has none of them:
    it gets rank 0 of 1 on a free loopback port for the build only, and the variables are removed again afterwards,
    so that accelerate still sees one process, not a distributed run of one."""
    import torch
    import torch.distributed as dist

    from alignpipe.launch import free_port

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist.is_available() and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:  # each rank's NCCL communicator on its own GPU, where vLLM will put its engine (LOCAL_RANK)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    added = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    for name in added:
        os.environ[name] = defaults.get(name) or str(free_port())
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _has_engine_arg(name: str) -> bool:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return name in {f.name for f in dataclasses.fields(EngineArgs)}


def _sampled_logprobs(output, ids: list[int]) -> list[float]:
    """Each sampled token's log-prob from a vLLM completion asked for `logprobs=0` (per position, a mapping of token
    id to its Logprob); NaN where vLLM gave none."""
    out = []
    for t, token in enumerate(ids):
        entry = output.logprobs[t].get(token) if output.logprobs is not None and t < len(output.logprobs) else None
        value = getattr(entry, "logprob", math.nan) if entry is not None else math.nan
        out.append(math.nan if value is None else float(value))
    return out


class VLLMServerEngine:
    """OpenAI-compatible completions endpoint (`vllm serve MODEL`); with `sync="adapter"`, a LoRA policy's adapter
    loaded into it before each rollout (`adapter_dir`: where it is saved for the server to read)."""

    def __init__(
        self,
        base_url: str,
        tokenizer,
        model_name: str | None = None,
        timeout_s: float = 600.0,
        sync: str = "none",
        adapter_dir: str | Path | None = None,
        retries: int = 3,
        api_key: str | None = None,
        logprobs_mode: str = "raw_logprobs",
    ):
        self.base = base_url.rstrip("/").removesuffix("/v1")  # `http://host:8000/v1`, as OpenAI's clients take it
        self.tok = tokenizer
        self.timeout_s, self.retries = timeout_s, retries  # a rollout asked again after a 5xx, a reset or a timeout
        self.model_name = model_name
        self._key = api_key  # in the Authorization header only: never an error, a log or a repr
        self.logprobs_mode = logprobs_mode  # what the server was started with (`--logprobs-mode`): it cannot say
        self.adapters = AdapterSync(self.base, adapter_dir, timeout_s, api_key, retries) if sync == "adapter" else None

    def _model(self, client) -> str:
        if self.adapters is not None and self.adapters.loaded is not None:
            return self.adapters.loaded
        if self.model_name is None:
            answer = json_with_retries(
                lambda: client.get(f"{self.base}/v1/models"),
                f"the vLLM rollout server {self.base}/v1/models",
                self.retries,
                self.timeout_s,
                quote=True,
                key=self._key,
            )
            self.model_name = answer["data"][0]["id"]
        return self.model_name

    @property
    def copies_weights(self) -> bool:
        """Whether `update_weights` sends the server anything (its adapter): its time is then the rollout's sync."""
        return self.adapters is not None

    def update_weights(self, model) -> None:
        """With adapter sync, the policy's adapter loaded into the server as the model rollouts ask for; else
        nothing (the server owns its weights)."""
        if self.adapters is not None:
            self.adapters.push(model)

    def close(self) -> None:
        """The last adapter unloaded from the server and its folder removed (a stage's end)."""
        if self.adapters is not None:
            self.adapters.drop_loaded()

    def generate(
        self,
        prompts,
        n: int = 1,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> list[Generation]:
        import httpx

        if logprobs and self.logprobs_mode != "processed_logprobs":
            raise ValueError(
                "the vLLM server engine gives the sampler's log-probs only from a server started with "
                "`--logprobs-mode processed_logprobs` (rollout `logprobs_mode: processed_logprobs`); by default a "
                "server's are the raw model's, before temperature and filters. Use rollout mode 'colocate' or the hf "
                "backend for sampling_correction, or set sampling_correction: none"
            )

        sampling = sampling or SamplingParams()
        payload = {
            "prompt": list(prompts),
            "n": n,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.top_k:
            payload["top_k"] = sampling.top_k
        if sampling.min_p:
            payload["min_p"] = sampling.min_p
        if sampling.repetition_penalty != 1.0:
            payload["repetition_penalty"] = sampling.repetition_penalty  # a vLLM extension of the OpenAI API
        if seed is not None:
            payload["seed"] = seed
        payload["return_token_ids"] = True  # a vLLM extension; older servers ignore fields they do not know
        if logprobs:
            payload["logprobs"] = 1  # each sampled token's own log-prob is in `token_logprobs` beside its 1 best
        with httpx.Client(timeout=self.timeout_s, headers=auth_headers(self._key)) as client:
            payload["model"] = self._model(client)
            answer = json_with_retries(
                lambda: client.post(f"{self.base}/v1/completions", json=payload),
                f"the vLLM rollout server {self.base}/v1/completions (model {payload['model']!r})",
                self.retries,
                self.timeout_s,
                quote=True,
                key=self._key,
            )
            choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"server returned {len(choices)} completions for {len(prompts)} prompts × n={n}")
        gens = []
        for k, c in enumerate(choices):
            sampled = c.get("token_ids")
            ids = list(sampled) if sampled is not None else self.tok(c["text"], add_special_tokens=False)["input_ids"]
            logps = self._sampled_logprobs(c, ids) if logprobs else None
            reason: FinishReason = "stop" if c.get("finish_reason") == "stop" else "length"
            if reason == "stop" and (sampled is None or not ids or ids[-1] != self.tok.eos_token_id):
                ids = ids + [self.tok.eos_token_id]  # the text leaves the stop token out; a stop string is not one
                if logps is not None:
                    logps.append(math.nan)  # the server did not sample it
            gens.append(Generation(k // n, c["text"], ids, reason, logps))
        return gens

    def _sampled_logprobs(self, choice: dict, ids: list[int]) -> list[float]:
        """Each sampled token's log-prob from a completion asked with `logprobs` (its `token_logprobs`, one per
        token id); NaN where the server gave none."""
        if choice.get("token_ids") is None:
            raise RuntimeError(
                f"the vLLM server at {self.base} returned no token ids (`return_token_ids`, vLLM ≥ 0.10.2): its "
                "completions' text tokenized again need not be the tokens it sampled, so their log-probs cannot be "
                "lined up with them for sampling_correction. Upgrade the server, or set sampling_correction: none"
            )
        listed = (choice.get("logprobs") or {}).get("token_logprobs") or []
        values = [math.nan if v is None else float(v) for v in listed[: len(ids)]]
        return values + [math.nan] * (len(ids) - len(values))


class AdapterSync:
    """A LoRA policy's adapter kept loaded in a vLLM server (`VLLMServerEngine(sync="adapter")`): each `push`
    saves the adapter to `folder/<name>` and asks the server to load it under that new name, then unloads the
    previous one and deletes its folder. A new name each time because a vLLM server refuses to load a name it
    holds (only newer ones take `load_inplace`). Each engine names its adapters with its own random prefix, so the
    processes of a multi-process stage, or two runs on one server, never unload each other's."""

    def __init__(
        self, base: str, folder: str | Path | None, timeout_s: float, api_key: str | None = None, retries: int = 3
    ):
        import uuid

        self.base = base
        self._key = api_key
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="alignpipe-adapters-"))
        self.timeout_s, self.retries = timeout_s, retries
        self.prefix = f"alignpipe-policy-{uuid.uuid4().hex[:8]}"
        self.pushed = 0
        self.loaded: str | None = None

    def push(self, model) -> None:
        import httpx

        if not hasattr(model, "peft_config"):
            raise ValueError(
                "rollout `sync: adapter` loads the policy's LoRA adapter into the vLLM server, and this policy has "
                "no adapter: train with `lora`, or sample with `mode: colocate`"
            )
        self.pushed += 1
        name = f"{self.prefix}-{self.pushed}"
        path = (self.folder / name).resolve()
        model.save_pretrained(str(path))
        with httpx.Client(timeout=self.timeout_s, headers=auth_headers(self._key)) as client:
            try:
                self._load(client, name, path, model)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            previous, self.loaded = self.loaded, name
            if previous is not None:
                self._unload(client, previous)

    def _load(self, client, name: str, path: Path, model) -> None:
        """`name` loaded from `path`, asked up to `retries` times on a timeout, a reset, a 5xx or a 429 (backing off
        1, 2, 4 s, or a 429's Retry-After). A retry refused where the server lists the name among its models finds
        the attempt before it done: the server had loaded it and its answer was lost."""
        import httpx

        answer, attempts = answer_with_retries(
            lambda: client.post(f"{self.base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}),
            self.retries,
        )
        if isinstance(answer, httpx.TransportError):
            raise RuntimeError(
                f"the vLLM server at {self.base} could not be reached to load the policy's LoRA adapter before a "
                f"rollout ({type(answer).__name__}: {answer}; {attempts} attempt(s), {self.timeout_s:g} s timeout "
                "each); is `vllm serve` running there?"
            ) from answer
        if answer.is_error and not (attempts > 1 and answer.status_code == 400 and self._listed(client, name)):
            raise RuntimeError(self._refusal(answer, model))

    def _listed(self, client, name: str) -> bool:
        """Whether the server's `/v1/models` lists `name` (vLLM lists each LoRA adapter it holds there)."""
        try:
            response = client.get(f"{self.base}/v1/models")
            return not response.is_error and any(m.get("id") == name for m in response.json().get("data", []))
        except Exception:  # no list to read: the refusal stands
            return False

    def drop_loaded(self) -> None:
        import httpx

        if self.loaded is not None:
            with httpx.Client(timeout=self.timeout_s, headers=auth_headers(self._key)) as client:
                self._unload(client, self.loaded)
            self.loaded = None
        with contextlib.suppress(OSError):  # the folder left empty; one the user keeps other files in stays
            self.folder.rmdir()

    def _unload(self, client, name: str) -> None:
        """Unloaded from the server and its folder deleted; a server that fails to unload it is told once in the
        log (the adapter stays registered there, a few MB) and the run goes on."""
        try:
            response = client.post(f"{self.base}/v1/unload_lora_adapter", json={"lora_name": name})
            failed = (
                f"HTTP {response.status_code}: {server_message(response, self._key)}" if response.is_error else None
            )
        except Exception as e:  # the server gone at a stage's end: nothing left to free there
            failed = f"{type(e).__name__}: {e}"
        if failed:
            logging.getLogger(__name__).warning(
                "the vLLM server at %s did not unload the rollout adapter %r (%s)", self.base, name, failed
            )
        shutil.rmtree(self.folder / name, ignore_errors=True)

    def _refusal(self, response, model) -> str:
        """Why the server did not load the adapter, with what to change on the server."""
        said = server_message(response, self._key)
        start = (
            f"the vLLM server at {self.base} did not load the policy's LoRA adapter (HTTP {response.status_code}: "
            f"{said})"
        )
        if response.status_code == 404 and route_missing(response):
            return (
                f"{start}: it has no runtime LoRA API. Start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its "
                f"environment and `vllm serve <the stage's starting model> --enable-lora --max-lora-rank "
                f"{_rank(model)}`"
            )
        return (
            f"{start}. It needs `--enable-lora` and `--max-lora-rank` ≥ {_rank(model)}, the stage's starting model as "
            f"the served model, and read access to {self.folder} (rollout `adapter_dir`) at that same path"
        )


def route_missing(response) -> bool:
    """FastAPI's own answer to a path no route serves: vLLM mounts the LoRA routes only where runtime updating is
    allowed. vLLM's own 404s (an adapter it does not hold) carry its error object instead."""
    try:
        return response.json() == {"detail": "Not Found"}
    except ValueError:
        return False


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's `--max-lora-rank` takes."""


def max_lora_rank(r: int) -> int:
    """The `--max-lora-rank` a server needs for adapters of rank `r`: vLLM's smallest choice that holds it."""
    return next((m for m in MAX_LORA_RANKS if m >= r), r)


def _rank(model) -> int:
    config = next(iter(model.peft_config.values()))
    ranks = [config.r, *(getattr(config, "rank_pattern", None) or {}).values()]
    return max_lora_rank(int(max(ranks)))
