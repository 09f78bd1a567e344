"""The generation interface (hf backend) and the judging math."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support import known

from alignpipe.engine.hf import HFEngine, _takes_padding_mask
from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.rewards import RewardFunctionError, exact_match, load_reward_fn, score, sentiment_lexicon
from alignpipe.judges.winrate import wilson_interval, win_rate
from alignpipe.modeling import load_causal_lm, load_tokenizer
from alignpipe.recipe.stages import FormatStage


@pytest.fixture(scope="module")
def engine(tiny):
    return HFEngine(load_causal_lm(str(tiny / "model")), load_tokenizer(str(tiny / "model")), batch_size=3)


def test_n_completions_per_prompt_grouped_and_bounded(engine):
    prompts = ["The film", "I watched it and", "A very long opening sentence about a movie"]
    out = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=5), seed=0)
    assert [g.prompt_index for g in out] == [0, 0, 1, 1, 2, 2]
    for g in out:
        assert len(g.completion_ids) <= 5
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] == engine.tok.eos_token_id
    assert engine.tok.padding_side == "right", "left padding is restored afterwards"


def test_a_labelled_engine_shows_its_progress_and_samples_the_same(engine, capsys):
    """`HFEngine(progress=...)` (the judge's models): a bar of completions done, on stderr; the same tokens."""
    s = SamplingParams(max_new_tokens=4, temperature=1.0)
    prompts = ["The film", "I watched it and", "A long one", "Short"]
    plain = [g.completion_ids for g in engine.generate(prompts, 2, s, seed=3)]
    capsys.readouterr()
    engine.progress = "judge j: sft"
    try:
        labelled = [g.completion_ids for g in engine.generate(prompts, 2, s, seed=3)]
    finally:
        engine.progress = None
    assert labelled == plain
    err = capsys.readouterr().err
    assert "judge j: sft: 100%" in err and "8/8" in err


def test_seed_reproducibility_and_greedy(engine):
    s = SamplingParams(max_new_tokens=6, temperature=1.0)
    a = [g.completion_ids for g in engine.generate(["The film"], 2, s, seed=7)]
    b = [g.completion_ids for g in engine.generate(["The film"], 2, s, seed=7)]
    assert a == b
    g = SamplingParams(max_new_tokens=6, temperature=0)
    assert engine.generate(["x"], 1, g)[0].completion_ids == engine.generate(["x"], 1, g)[0].completion_ids


def test_wilson_interval_matches_hand_computation():
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_win_rate_counts_ties_as_half():
    wr = win_rate([3, 1, 2, 0, 0.3 + 1e-12], [1, 1, 5, 0, 0.3])
    assert (wr.wins, wr.ties, wr.losses) == (1, 3, 1), "scores 1e-12 apart are a tie"
    wr = win_rate([3, 1, 2, 0], [1, 1, 5, 0])
    assert wr.win_rate == pytest.approx(0.5)
    assert wr.ci_low < 0.5 < wr.ci_high


def test_builtin_rewards():
    assert sentiment_lexicon([""], ["a great and wonderful film"])[0] == pytest.approx(2.5)
    assert sentiment_lexicon([""], ["boring mess"])[0] == pytest.approx(-2.5)
    assert exact_match(["1+1="], ["2", "3"][:1], answer=["2"]) == [1.0]
    assert exact_match(["1+1="], ["3"]) == [None]


def test_reward_function_errors_name_the_function():
    with pytest.raises(RewardFunctionError, match="cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:fn")
    with pytest.raises(RewardFunctionError, match="neither a built-in"):
        load_reward_fn("nonsense")
    with pytest.raises(RewardFunctionError, match="returned 1 values for 2 completions"):
        score(lambda p, c, **_: [1.0], "bad", ["a", "b"], ["x", "y"])
    assert load_reward_fn("alignpipe.judges.rewards:length") is not None


def greedy_generate(model, tok, prompt: str, **config) -> list[int]:
    """`model.generate`'s greedy new tokens for one unpadded prompt (`config`: GenerationConfig fields)."""
    from transformers import GenerationConfig

    config = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **config}
    enc = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, generation_config=GenerationConfig(do_sample=False, **config))
    return out[0, enc["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("static_cache", [False, True])
def test_a_turn_ends_at_any_eos_of_the_generation_config(engine, static_cache):
    """Gemma-style instruct models end a turn with a token the tokenizer does not call EOS (`<end_of_turn>` beside
    `<eos>`), listed in the model's generation config: `model.generate` stops there, and so does the engine (finish
    reason "stop", the completion cut after it, as with EOS)."""

    from alignpipe.special_tokens import stop_token_ids

    tok, greedy = engine.tok, SamplingParams(temperature=0, max_new_tokens=12)
    model = copy.deepcopy(engine.model)
    (free,) = HFEngine(model, tok, 8, static_cache=static_cache).generate(["The film"], 1, greedy)
    turn_end = next(i for i in free.completion_ids[2:] if i != tok.eos_token_id)  # a token it writes on its way
    model.generation_config.eos_token_id = [tok.eos_token_id, turn_end]
    assert stop_token_ids(tok, model) == [tok.eos_token_id, turn_end] and stop_token_ids(tok) == [tok.eos_token_id]

    (ended,) = HFEngine(model, tok, 8, static_cache=static_cache).generate(["The film"], 1, greedy)
    cut = free.completion_ids.index(turn_end) + 1
    assert ended.completion_ids == free.completion_ids[:cut] and ended.finish_reason == "stop"
    theirs = greedy_generate(model, tok, "The film", max_new_tokens=12, eos_token_id=[tok.eos_token_id, turn_end])
    assert theirs[:cut] == ended.completion_ids


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_greedy_decoding_equals_transformers_generate(engine, attention):
    """The engine's own decode loop (KV cache, left padding, early stop) against `model.generate`; on `varlen` too,
    whose decode steps take the ready 4-D mask and hand it to SDPA."""
    import torch
    from transformers import GenerationConfig

    from alignpipe.modeling import implementation

    prompts = ["The film", "I watched it and", "A", "Honestly, the plot was"]
    model = copy.deepcopy(engine.model)
    model.set_attn_implementation(implementation(attention))
    assert _takes_padding_mask(model)
    ours = [
        g.completion_ids
        for g in HFEngine(model, engine.tok, 8).generate(prompts, 1, SamplingParams(temperature=0, max_new_tokens=20))
    ]
    tok = engine.tok
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    tok.padding_side = side
    with torch.no_grad():
        ref = engine.model.generate(
            **enc,
            generation_config=GenerationConfig(
                max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
            ),
        )
    for mine, theirs in zip(ours, ref[:, enc["input_ids"].shape[1] :].tolist()):
        if tok.eos_token_id in theirs:
            theirs = theirs[: theirs.index(tok.eos_token_id) + 1]
        else:
            theirs = [i for i in theirs if i != tok.pad_token_id]
        assert mine == theirs


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.3, min_p=0.1),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    ],
)
def test_sampling_filters_match_transformers_warpers(params):
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from alignpipe.engine.hf import filter_logits

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    warpers: list[Any] = [TemperatureLogitsWarper(params["temperature"])]
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p"):
        warpers.append(TopPLogitsWarper(params["top_p"]))
    if params.get("min_p"):
        warpers.append(MinPLogitsWarper(params["min_p"]))
    expected = logits.clone()
    for w in warpers:
        expected = w(None, expected)
    ours = filter_logits(logits, SamplingParams(max_new_tokens=1, **params))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert torch.allclose(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)], atol=1e-5)


def test_greedy_samples_of_a_shared_prefill_equal_each_row_decoded_whole(engine):
    """`n` samples per prompt prefill the prompt once and repeat its KV cache: with greedy decoding every
    sample equals the prompt decoded on its own row, padded prompts included."""
    import torch

    from alignpipe.engine.hf import decode

    tok = engine.tok
    enc = HFEngine(engine.model, tok)._encode([tok("The film")["input_ids"], tok("I watched it and the")["input_ids"]])
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    with torch.no_grad():
        shared, _ = decode(engine.model, enc["input_ids"], enc["attention_mask"], greedy, None, tok.pad_token_id, n=3)
        whole, _ = decode(
            engine.model,
            enc["input_ids"].repeat_interleave(3, 0),
            enc["attention_mask"].repeat_interleave(3, 0),
            greedy,
            None,
            tok.pad_token_id,
        )
    assert shared.shape == (6, 12) and torch.equal(shared, whole)


def test_inverse_cdf_sampling_follows_the_distribution_and_never_draws_filtered_tokens():
    import torch

    from alignpipe.engine.hf import sample

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]).repeat(50_000, 1)
    draws = sample(probs, torch.Generator().manual_seed(0))
    first = torch.bincount(draws[0::2], minlength=5).float() / 50_000
    assert torch.allclose(first, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]), atol=0.01) and first[1] == first[4] == 0
    assert (draws[1::2] == 4).all()
    again = sample(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)  # seeded


def test_a_uniform_on_the_total_draws_the_last_possible_token_not_a_filtered_one(monkeypatch):
    """The uniform is kept strictly below the cumulative total (`torch.minimum` with the float below it), so even a
    draw at the very top lands on the last token with a probability above 0, never on the filtered ones after it,
    without a pass over the vocabulary to check."""
    from alignpipe.engine import hf

    probs = torch.tensor([[0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(hf.torch, "rand", lambda *shape, **kw: torch.ones(*shape))  # the worst rounding: u = total
    assert hf.sample(probs).tolist() == [2, 1]


def test_vllm_colocate_weight_sync_keeps_the_lora_adapter_in_training(tiny):
    """`update_weights` hands vLLM the merged weights (equal to `merge_and_unload()` of a copy) and leaves the live
    policy a peft model with every LoRA parameter still trainable (merging the live policy stripped them: 56 → 0)."""
    import copy

    import torch

    from alignpipe.engine.vllm import VLLMColocateEngine
    from alignpipe.modeling import lora_model
    from alignpipe.trainers.configs import LoraSpec

    policy = lora_model(load_causal_lm(str(tiny / "model")), LoraSpec(r=4))
    with torch.no_grad():  # a trained adapter: lora_B starts at zero, which would make any merge look right
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    lora_before = {n for n, p in policy.named_parameters() if "lora_" in n and p.requires_grad}
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()

    loaded: dict = {}

    class FakeVLLMModel:
        def load_weights(self, weights):
            loaded.update({k: v.clone() for k, v in weights})

    class FakeLLM:  # the V0 layout `_vllm_model` reads
        llm_engine = type(
            "E",
            (),
            {
                "model_executor": type(
                    "X",
                    (),
                    {"driver_worker": type("W", (), {"model_runner": type("R", (), {"model": FakeVLLMModel()})()})()},
                )()
            },
        )()

    engine = object.__new__(VLLMColocateEngine)
    engine.llm, engine._asleep = FakeLLM(), False
    engine.update_weights(policy)
    assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert hasattr(policy, "peft_config")
    assert {n for n, p in policy.named_parameters() if "lora_" in n and p.requires_grad} == lora_before and lora_before


def test_vllm_colocate_wakes_its_weights_loads_them_then_wakes_its_kv_cache(tiny):
    """An engine asleep between rollouts wakes its weights, takes the policy's, and only then allocates its KV cache
    again (less memory held while the weights are merged and copied); an awake one is not woken."""
    from alignpipe.engine.vllm import VLLMColocateEngine

    calls: list = []
    model = type("M", (), {"load_weights": lambda self, weights: calls.append(("load", len(list(weights))))})()
    runner = type("R", (), {"model": model})()
    executor = type(
        "X", (), {"driver_worker": type("W", (), {"worker": type("V", (), {"model_runner": runner})()})()}
    )()

    class FakeLLM:  # V1 under the external launcher: the driver worker wraps the worker holding the runner
        llm_engine = type("E", (), {"model_executor": executor})()

        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags or ())))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    policy = load_causal_lm(str(tiny / "model"))
    engine = object.__new__(VLLMColocateEngine)
    engine.llm, engine._asleep = FakeLLM(), True
    engine.update_weights(policy)
    n = len(policy.state_dict())
    assert calls == [("wake_up", ("weights",)), ("load", n), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert not engine._asleep
    calls.clear()
    engine.update_weights(policy)
    assert calls == [("load", n), ("reset_prefix_cache",)]


def _fake_vllm(monkeypatch, built: list):
    """A stand-in `vllm` package with what `VLLMColocateEngine` imports: `LLM` (recording its arguments and the
    launcher variables it saw while built) and `EngineArgs` (a dataclass with `logprobs_mode`)."""
    import dataclasses
    import os
    import sys
    import types

    from alignpipe.engine.vllm import LAUNCHER_VARIABLES

    class LLM:
        def __init__(self, **kwargs):
            built.append((kwargs, {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}))

    @dataclasses.dataclass
    class EngineArgs:
        logprobs_mode: str = "raw_logprobs"

    vllm: Any = types.ModuleType("vllm")
    vllm.LLM = LLM
    engine = types.ModuleType("vllm.engine")
    arg_utils: Any = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    for name, module in (("vllm", vllm), ("vllm.engine", engine), ("vllm.engine.arg_utils", arg_utils)):
        monkeypatch.setitem(sys.modules, name, module)


def test_vllm_colocate_runs_its_engine_in_this_process_with_the_launcher_variables_for_the_build_only(
    tiny, monkeypatch
):
    """The colocate engine's `LLM` is built with vLLM's external launcher (its engine in the training process, where
    the policy's weights are handed over as GPU tensors), under rank 0 of 1 on a free loopback port when the process
    has no launcher variables, and those are gone again afterwards (accelerate must still see one process)."""
    import os

    from alignpipe.engine.vllm import LAUNCHER_VARIABLES, VLLMColocateEngine

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    built: list = []
    _fake_vllm(monkeypatch, built)
    model, tok = load_causal_lm(str(tiny / "model")), load_tokenizer(str(tiny / "model"))
    engine = VLLMColocateEngine(
        model, tok, gpu_memory_utilization=0.25, sleep_between_rollouts=False, seed=3, max_model_len=320
    )
    ((kwargs, seen),) = built
    assert kwargs["max_model_len"] == 320
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["model"] == str(tiny / "model") and kwargs["seed"] == 3 and kwargs["gpu_memory_utilization"] == 0.25
    assert kwargs["enable_sleep_mode"] is False and kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.processed_logprobs
    assert {k: v for k, v in seen.items() if k != "MASTER_PORT"} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(seen["MASTER_PORT"]) < 65536
    assert not any(name in os.environ for name in LAUNCHER_VARIABLES)

    # a launcher's own variables (one process of `accelerate launch`, say) are used as they are and left in place
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("WORLD_SIZE", "1")
    built.clear()
    VLLMColocateEngine(model, tok, sleep_between_rollouts=False)
    assert built[0][1]["MASTER_PORT"] == "29999" and built[0][1]["RANK"] == "0"
    assert "max_model_len" not in built[0][0]  # none given: vLLM's own, the model's whole context
    assert os.environ["MASTER_PORT"] == "29999" and "RANK" not in os.environ


def test_a_vllm_colocate_engine_is_sized_for_the_stages_longest_rollout(tiny, monkeypatch):
    """`max_model_len` of a colocate engine: the stage's longest prompt (cut to `max_prompt_length`) plus
    `max_completion_length`, within the model's declared positions; the recipe's own value wins; none with tools
    (their turns grow a completion) or a server; refused on the hf engine."""
    from types import SimpleNamespace

    from alignpipe.engine import factory
    from alignpipe.positions import rollout_window
    from alignpipe.special_tokens import encode
    from alignpipe.stages.online import _vllm_window
    from alignpipe.trainers.configs import RolloutSpec

    tok = load_tokenizer(str(tiny / "model"))
    prompts = ["The film", "I watched it and then I watched it again, twice over, all of it", "A movie"]
    longest = max(len(ids) for ids in encode(tok, prompts))
    config = SimpleNamespace(max_position_embeddings=10_000)
    assert rollout_window(tok, prompts, None, 48, config) == longest + 48
    assert rollout_window(tok, prompts, 4, 48, config) == 4 + 48
    assert rollout_window(tok, prompts, 10_000, 48, config) == longest + 48  # the prompts are shorter than the cut
    assert rollout_window(tok, prompts, None, 48, SimpleNamespace(max_position_embeddings=20)) == 20
    assert rollout_window(tok, prompts, None, 48, SimpleNamespace()) == longest + 48

    def ctx(rollout, tools=()):
        # the data stage, built unvalidated with the one field read (no id, dataset or format)
        data = FormatStage.model_construct(tools=list(tools))  # type: ignore[call-arg]

        stage = SimpleNamespace(rollout=rollout, data="d", max_prompt_length=None, max_completion_length=48)
        return SimpleNamespace(stage=stage, recipe=SimpleNamespace(stage=lambda _: data))

    colocate = RolloutSpec(backend="vllm")
    assert _vllm_window(ctx(colocate), tok, config, lambda: prompts) == longest + 48
    assert _vllm_window(ctx(colocate, tools=["calculator"]), tok, config, lambda: prompts) is None
    server = RolloutSpec(backend="vllm", mode="server", server_url="http://x")
    assert _vllm_window(ctx(server), tok, config, lambda: prompts) is None

    made: list = []
    monkeypatch.setattr("alignpipe.engine.vllm.VLLMColocateEngine", lambda *args, **kwargs: made.append(kwargs))
    factory.make_engine(colocate, None, tok, window=200)
    factory.make_engine(RolloutSpec(backend="vllm", max_model_len=4096), None, tok, window=200)
    factory.make_engine(colocate, None, tok)
    assert [m["max_model_len"] for m in made] == [200, 4096, None]
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutSpec(max_model_len=4096)
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutSpec(backend="vllm", mode="server", server_url="http://x", max_model_len=4096)


def _join_as_rank(rank: int, port: int, result) -> None:
    import os

    import torch.distributed as dist

    from alignpipe.engine.vllm import launcher_environment

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    with launcher_environment():
        made = dist.is_initialized() and dist.get_world_size() == 2 and dist.get_rank() == rank
    dist.barrier()
    result.put((rank, made, os.environ["WORLD_SIZE"]))
    dist.destroy_process_group()


def test_vllm_colocate_on_a_multi_process_stage_joins_the_stages_process_group():
    """Each rank of a 2-process stage builds its engine inside the stage's process group (made from the launcher's
    variables before vLLM sees them, as the trainer's accelerator would), and keeps the launcher's variables."""
    import torch.multiprocessing as mp

    from alignpipe.launch import free_port

    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_join_as_rank, args=(rank, port, result)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(result.get() for _ in range(2)) == [(0, True, "2"), (1, True, "2")]


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A briefly SFT-trained tiny model: it ends completions with EOS, so rows stop at different steps."""
    from support import tiny_split

    from alignpipe.tracking import Tracker
    from alignpipe.trainers import sft
    from alignpipe.trainers.configs import SFTConfig

    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=200, max_length=64)
    model = load_causal_lm(str(tiny / "model"))
    cfg = SFTConfig(learning_rate=3e-3, max_steps=40, batch_size=16)
    sft.train(cfg, model, tok, train, [], Tracker(), tmp_path_factory.mktemp("static"))
    return model.eval(), tok


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_static_cache_decoding_gives_the_same_tokens(trained, n, temperature):
    """The fixed-shape static-cache loop against the dynamic one (itself equal to `model.generate` when greedy):
    the same tokens and lengths, greedy and sampled with one seed, one sample or several per prompt, with rows that
    stop early and rows that run to the limit."""
    model, tok = trained
    prompts = ["The film", "I watched it and", "A", "Honestly, the plot was", "What a"]
    reasons = []
    for limit in (24, 3):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=limit)
        dynamic = HFEngine(model, tok, 8).generate(prompts, n, sampling, seed=3)
        static = HFEngine(model, tok, 8, static_cache=True).generate(prompts, n, sampling, seed=3)
        assert [g.completion_ids for g in static] == [g.completion_ids for g in dynamic], limit
        reasons += [g.finish_reason for g in dynamic]
    assert "stop" in reasons and "length" in reasons, reasons


@pytest.mark.parametrize("static_cache", [False, True])
def test_repetition_penalty_is_transformers_rule_and_both_loops_agree(trained, static_cache):
    """Greedy with `repetition_penalty` equals `model.generate`'s (one unpadded prompt: transformers counts left
    padding as seen tokens, vLLM and we do not), and changes what a repetitive model writes; sampled, the two loops
    give the same tokens from one seed, several samples per prompt."""

    model, tok = trained
    greedy = SamplingParams(temperature=0, max_new_tokens=24, repetition_penalty=1.8)
    (ours,) = HFEngine(model, tok, 8, static_cache=static_cache).generate(["The film"], 1, greedy)
    theirs = greedy_generate(model, tok, "The film", max_new_tokens=24, repetition_penalty=1.8)
    assert ours.completion_ids == theirs[: len(ours.completion_ids)] and len(ours.completion_ids) > 3
    (plain,) = HFEngine(model, tok, 8, static_cache=static_cache).generate(
        ["The film"], 1, greedy.model_copy(update={"repetition_penalty": 1.0})
    )
    assert plain.completion_ids != ours.completion_ids, "the penalty changed the greedy text"
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, repetition_penalty=1.3)
    prompts = ["The film", "I watched it and", "A"]
    dynamic = HFEngine(model, tok, 8).generate(prompts, 3, sampled, seed=5)
    static = HFEngine(model, tok, 8, static_cache=True).generate(prompts, 3, sampled, seed=5)
    assert [g.completion_ids for g in static] == [g.completion_ids for g in dynamic]


def test_static_cache_decoding_prefills_each_prompt_once(trained, monkeypatch):
    """GRPO samples `n` completions per prompt: the static loop runs each prompt through the model once and writes its
    keys and values into its samples' rows (the same tokens as above), where it used to prefill every sample."""
    model, tok = trained
    prompts = ["The film", "I watched it and", "A"]
    widths = []
    forward = model.forward

    def counting(*args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.size(1) > 1:
            widths.append(ids.size(0))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    got = HFEngine(model, tok, 8, static_cache=True).generate(prompts, 4, sampling, seed=1)
    assert widths == [3] and len(got) == 12


def test_compiled_decode_steps_give_the_same_tokens(trained):
    """`rollout: {compile: true}`: the decode step compiled (on a GPU a CUDA graph; here inductor's CPU code), prompts
    left-padded to 64 tokens. The same tokens as the eager loop, greedy and sampled, one sample or three, the first
    replay's check against the eager step passing; a second rollout of another width reuses the compiled step, and
    training the weights in place reaches it."""
    from alignpipe.engine.decode_steps import CHECK_CALL

    model, tok = trained
    prompts = ["The film", "I watched it and", "A", "Honestly, the plot was", "What a"]
    engine = HFEngine(model, tok, 8, compile=True)
    for n, temperature in ((1, 0), (3, 1.0)):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=12)
        eager = HFEngine(model, tok, 8).generate(prompts, n, sampling, seed=3)
        compiled = engine.generate(prompts, n, sampling, seed=3)
        assert [g.completion_ids for g in compiled] == [g.completion_ids for g in eager], (n, temperature)
    assert engine.step is not None and len(engine.step.caches) == 2, "one static cache per rows × length, reused"
    step: Any = engine.step  # the test's stand-in counts its calls
    assert step.failed is None and min(step.calls.values()) >= CHECK_CALL, "checked, never given up"
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    with torch.no_grad():
        for p in model.parameters():  # an optimizer step, in place
            p.mul_(1.01)
    try:
        assert [g.completion_ids for g in engine.generate(prompts[:3], 1, greedy)] == [
            g.completion_ids for g in HFEngine(model, tok, 8).generate(prompts[:3], 1, greedy)
        ]
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.01)


def test_compiled_decode_widths_only_grow_in_powers_of_two_and_drop_the_narrower_caches(trained):
    """A run compiles the step once per shape: prompt widths round up to a power of two, at least 64, and never fall
    below the widest so far; a wider rollout's cache replaces the narrower ones, which are never run again."""
    from alignpipe.engine.decode_steps import CompiledDecodeStep

    model, _ = trained
    step = CompiledDecodeStep()
    assert [step.width(w) for w in (5, 64, 65, 40, 130, 7)] == [64, 64, 128, 128, 256, 256]
    step.cache(model, 4, 64 + 12), step.cache(model, 8, 64 + 12)
    assert len(step.caches) == 2
    step.cache(model, 4, 128 + 12)
    assert [k[1:] for k in step.caches] == [(4, 140)]


@pytest.mark.parametrize("how", ["not compiling", "wrong logits"])
def test_a_compiled_decode_step_that_fails_or_is_wrong_is_given_up_for_the_eager_one(trained, caplog, how):
    """A compilation that raises, or a compiled step whose logits at its first replay are off from the eager step's,
    is reported once and replaced by the eager step: greedy tokens equal the eager loop's when it never ran, and the
    compiled step is not called again."""
    import logging

    model, tok = trained
    prompts = ["The film", "I watched it and", "A"]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    engine = HFEngine(model, tok, 8, compile=True)
    calls = []

    def broken(model, token, full_mask, pos, cache, cache_position):
        calls.append(1)
        if how == "not compiling":
            raise torch._dynamo.exc.TorchDynamoException("no Triton here")
        logits = decode_steps.decode_step(model, token, full_mask, pos, cache, cache_position)
        return logits.flip(-1)  # a graph that read the wrong buffers

    from alignpipe.engine import decode_steps

    step: Any = known(engine.step)  # the compiled step's function, replaced
    step.fn = broken

    with caplog.at_level(logging.WARNING, logger="alignpipe.engine.decode_steps"):
        got = engine.generate(prompts, 1, greedy)
        engine.generate(prompts, 1, greedy)
    assert len(caplog.records) == 1 and "the eager static-cache step runs instead" in caplog.text
    if how == "not compiling":
        assert calls == [1] and "did not compile (TorchDynamoException: no Triton here)" in str(step.failed)
        want = HFEngine(model, tok, 8).generate(prompts, 1, greedy)
        assert [g.completion_ids for g in got] == [g.completion_ids for g in want]
    else:
        assert len(calls) == decode_steps.CHECK_CALL and "logits are off from the eager step's" in str(step.failed)


def test_cuda_graph_decode_steps_give_the_same_tokens(trained):
    """`rollout: {cuda_graphs: true}`, the GPU default: the eager step recorded for each rollout and replayed on input
    buffers the loop copies each token's inputs into (here with a CPU stand-in for the recording). The same tokens as
    the eager loop, greedy and sampled, one sample or three, and after the weights were trained in place; the
    prompts keep their width; the static cache and the recording are freed when the rollout ends; each shape's
    first replay is checked against the eager step once. On CPU the engine itself never records."""
    from support import replayed_on_cpu

    from alignpipe.engine.decode_steps import GraphedDecodeStep
    from alignpipe.engine.hf import aligned

    model, tok = trained
    prompts = ["The film", "I watched it and", "A", "Honestly, the plot was", "What a"]
    assert HFEngine(model, tok, 8)._decode_step(torch.device("cpu")) is None
    engine = HFEngine(model, tok, 8)
    recorded = []
    engine.step = step = GraphedDecodeStep(capture=lambda fn: recorded.append(1) or replayed_on_cpu(fn))
    width = engine._encode(prompts)["input_ids"].size(1)
    for n, temperature in ((1, 0), (3, 1.0), (1, 0)):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=12)
        eager = HFEngine(model, tok, 8).generate(prompts, n, sampling, seed=3)
        graphed = engine.generate(prompts, n, sampling, seed=3)
        assert [g.completion_ids for g in graphed] == [g.completion_ids for g in eager], (n, temperature)
        assert not step.caches and not step.recordings, "freed for the training step"
    length = aligned(width + 12)  # the static cache's length, rounded up for the attention bias's rows
    assert step.failed is None and len(recorded) == 3 and step.checked == {(5, length), (15, length)}
    chunked = HFEngine(model, tok, 2)  # chunks of 2, 2 and 1 prompts: each recorded with no other alive
    alive = []
    chunked.step = in_chunks = GraphedDecodeStep(
        capture=lambda fn: alive.append(len(in_chunks.recordings)) or replayed_on_cpu(fn)
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    want = [g.completion_ids for g in HFEngine(model, tok, 2).generate(prompts, 2, sampling, seed=4)]
    assert [g.completion_ids for g in chunked.generate(prompts, 2, sampling, seed=4)] == want
    assert alive == [0, 0, 0], alive
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    with torch.no_grad():
        for p in model.parameters():  # an optimizer step
            p.mul_(1.01)
    try:
        want = [g.completion_ids for g in HFEngine(model, tok, 8).generate(prompts, 1, greedy)]
        assert [g.completion_ids for g in engine.generate(prompts, 1, greedy)] == want
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.01)


def test_a_recorded_step_reads_the_decode_loop_s_own_tensors_with_no_copy_a_token(trained, monkeypatch):
    """`decode_static` hands every step the same token, mask, position and cache-position tensors, advanced in place,
    and a recording keeps the tensors it was recorded with: no replay copies its inputs (on a GPU, four kernels a
    token fewer). A caller handing other tensors still gets their values copied in."""
    from support import replayed_on_cpu

    from alignpipe.engine import decode_steps
    from alignpipe.engine.decode_steps import GraphedDecodeStep

    copies = []
    original = decode_steps.Recording.__call__

    def spied(self, *values):
        copies.append(sum(v is not b for v, b in zip(values, self.inputs, strict=True)))
        return original(self, *values)

    monkeypatch.setattr(decode_steps.Recording, "__call__", spied)
    model, tok = trained
    engine = HFEngine(model, tok, 8)
    engine.step = GraphedDecodeStep(capture=replayed_on_cpu)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    got = engine.generate(["The film", "A"], 2, sampling, seed=1)
    assert [g.completion_ids for g in got] == [
        g.completion_ids for g in HFEngine(model, tok, 8).generate(["The film", "A"], 2, sampling, seed=1)
    ]
    assert len(copies) >= 5 and set(copies) == {0}, copies
    token, mask, pos, cache_position = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 4), torch.zeros(2, 1),
                                        torch.zeros(1, dtype=torch.long))  # fmt: skip
    recording = decode_steps.Recording.__new__(decode_steps.Recording)
    recording.inputs, recording.replay, recording.out = [token, mask, pos, cache_position], lambda: None, token
    recording(torch.ones(2, 1, dtype=torch.long), mask, pos + 3, cache_position)
    assert token.tolist() == [[1], [1]] and pos.tolist() == [[3.0], [3.0]] and copies[-1] == 2


def test_each_cuda_graph_recording_gets_a_memory_pool_of_its_own(trained, monkeypatch):
    """By default (`cuda_graph_capture`) every rollout's recording asks for a new memory pool: on an H200 with torch
    2.11, a second recording into the pool id of a dropped graph that still held blocks failed an allocator assert
    inside `capture_begin`, the step was given up, and the CUDA generator was left in capture mode. Here the CPU
    stand-in records, and the pools each recording was given are counted."""
    from support import replayed_on_cpu

    from alignpipe.engine import decode_steps

    pools = iter(range(100))
    given = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(pools)))
    monkeypatch.setattr(decode_steps, "cuda_graph_capture", lambda fn, pool: given.append(pool) or replayed_on_cpu(fn))
    model, tok = trained
    engine = HFEngine(model, tok, 8)
    engine.step = step = decode_steps.GraphedDecodeStep()
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    want = [g.completion_ids for g in HFEngine(model, tok, 8).generate(["The film", "A"], 1, greedy)]
    for _ in range(3):
        assert [g.completion_ids for g in engine.generate(["The film", "A"], 1, greedy)] == want
    assert step.failed is None and given == [("pool", 0), ("pool", 1), ("pool", 2)]


@pytest.mark.parametrize("how", ["not recording", "wrong replay"])
def test_a_cuda_graph_decode_step_that_fails_or_is_wrong_is_given_up_for_the_eager_one(trained, caplog, how):
    """A recording that raises (an operator a CUDA graph cannot hold), or a replay whose logits are off from the
    eager step's on the same inputs, is reported once; the eager step decodes from the same cache state, so the
    tokens equal the eager loop's, and nothing is recorded again."""
    import logging

    from support import replayed_on_cpu

    from alignpipe.engine.decode_steps import GraphedDecodeStep

    model, tok = trained
    prompts = ["The film", "I watched it and", "A"]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    calls = []

    def capture(step):
        calls.append(1)
        if how == "not recording":
            step()  # a warm-up ran (and advanced the cache's counters) before the failure
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        replay, out = replayed_on_cpu(step)
        return (lambda: (replay(), out.copy_(out.flip(-1)))), out  # a graph that read the wrong buffers

    engine = HFEngine(model, tok, 8)
    engine.step = GraphedDecodeStep(capture=capture)
    with caplog.at_level(logging.WARNING, logger="alignpipe.engine.decode_steps"):
        got = engine.generate(prompts, 1, greedy)
        engine.generate(prompts, 1, greedy)
    want = HFEngine(model, tok, 8).generate(prompts, 1, greedy)
    assert [g.completion_ids for g in got] == [g.completion_ids for g in want]
    assert len(caplog.records) == 1 and "`rollout: {cuda_graphs: false}`" in caplog.text
    assert calls == [1] and not engine.step.recordings
    if how == "not recording":
        assert "could not be recorded (RuntimeError: CUDA error: operation not permitted" in str(engine.step.failed)
    else:
        assert "logits are off from the eager step's" in str(engine.step.failed)


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@pytest.mark.parametrize("policy", ["plain", "lean", "lora"])
def test_the_decode_step_reads_nothing_back_from_the_device(trained, attention, policy):
    """What a CUDA graph can hold, checked on CPU: the static-cache decode step with its ready padding mask traces as
    one graph (`fullgraph=True`), so it has no `.item()`, no data-dependent branch and no mask built from the values
    on the host; any of them would be a read of the device, which a recording cannot contain. On both attention
    kernels a GPU decodes with, for a plain model, a policy patched as the trainers patch it, and a LoRA policy, with
    the static cache the graphed step records (`static_cache`)."""
    from peft import LoraConfig, get_peft_model

    from alignpipe.engine.decode_steps import decode_step, new_cache
    from alignpipe.lean_activations import lean_activations
    from alignpipe.modeling import attention_kernels, implementation

    model = copy.deepcopy(trained[0])
    model.set_attn_implementation(implementation(attention))
    if policy == "lean":
        assert lean_activations(model, fused=True) > 0
    if policy == "lora":
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.1)
        model = get_peft_model(model, config).eval()
    rows, width = 3, 8
    ids = torch.randint(3, 100, (rows, width))
    cache = new_cache(model, width + 4)  # its layers writing at positions shared per step, as on a GPU
    assert type(cache.layers[0]).__name__ == "SharedPositionLayer"
    keys = torch.zeros(rows, width + 4, dtype=torch.bool)
    keys[:, : width + 1] = True
    traced = torch.compile(decode_step, backend="eager", fullgraph=True)
    with torch.inference_mode(), attention_kernels():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(width), use_cache=True)
        args = (ids[:, -1:], keys[:, None, None, :], torch.full((rows, 1), width), cache, torch.tensor([width]))
        got = traced(model, *args)
    assert got.shape == (rows, model.config.vocab_size) and torch.isfinite(got).all()
    torch._dynamo.reset()


def test_a_static_cache_s_layers_work_out_where_to_write_once_a_step(trained):
    """`static_cache`: transformers' static layers each work out their write positions (an arange, an add, and an
    in-place add to their own counter: 3 kernels a layer a decode step); here the first layer to write in a forward
    does it for all. The positions are worked out once a step whatever the depth; the keys, values and tokens-written
    count after a prefill and three decode steps equal transformers' `StaticCache`'s, and again after `reset`. A
    model with sliding-window layers keeps transformers' cache."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import MistralConfig, StaticCache

    from alignpipe.engine.decode_steps import decode_step, new_cache
    from alignpipe.engine.static_cache import static_cache

    class Positions(TorchDispatchMode):
        """Counts two of the three operators that work out write positions (the third, an add, is not told apart
        from the model's own adds)."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.split(".")[0] in ("arange", "add_")
            return func(*args, **(kwargs or {}))

    model, _ = trained
    rows, width, steps = 3, 6, 3
    ids = torch.randint(3, 100, (rows, width + steps), generator=torch.Generator().manual_seed(0))
    keys = torch.ones(rows, width + steps, dtype=torch.bool)

    def fill(cache) -> list[int]:
        """Prefill and decode into `cache`; how many position operators each decode step ran."""
        counts = []
        model(input_ids=ids[:, :width], past_key_values=cache, use_cache=True)
        for t in range(width, width + steps):
            with Positions() as seen:
                decode_step(model, ids[:, t : t + 1], keys[:, None, None, :], torch.full((rows, 1), t), cache, None)
            counts.append(seen.count)
        return counts

    with torch.inference_mode():
        plain, shared = StaticCache(config=model.config, max_cache_len=width + steps), new_cache(model, width + steps)
        layers = len(shared.layers)
        assert layers > 1 and len({id(layer.cumulative_length) for layer in shared.layers}) == 1
        assert fill(plain) == [2 * layers] * steps and fill(shared) == [2] * steps, "arange and add_ once a step"
        for _ in range(2):
            mine: Any
            theirs: Any  # static layers: keys, values and the shared length
            for mine, theirs in zip(shared.layers, plain.layers, strict=True):
                assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
                assert int(mine.cumulative_length) == int(theirs.cumulative_length) == width + steps
            shared.reset(), plain.reset()
            assert not shared.layers[-1].keys.any() and int(shared.layers[0].cumulative_length) == 0
            fill(plain), fill(shared)
    sliding = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        sliding_window=8,
    )
    kept = static_cache(sliding, 32, "cpu")  # sliding-window layers write in their own way: left as they are
    assert [type(layer).__name__ for layer in kept.layers] == ["StaticSlidingWindowLayer"] * 2


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_decode_steps_hand_sdpa_a_bias_it_takes_as_it_is(trained, monkeypatch, static):
    """Given a boolean mask, SDPA makes an additive bias of it at every call (a fill and a `where`), and its
    memory-efficient kernel (a GPU's, for masked decode steps) copies a bias whose rows do not start at multiples of
    8 elements into a padded one: up to four kernels per layer per step. The decode loops hand it a bias in the
    model's dtype, rows aligned, that SDPA runs as it is (no `where` in a step); the tokens are unchanged (the other
    tests)."""
    from torch.profiler import profile

    from alignpipe.engine import hf

    model, tok = trained
    enc = HFEngine(model, tok)._encode(["The film", "I watched it and", "A"])
    masks: list[Any] = []
    converted: list[Any] = []
    original = model.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].size(1) > 1:  # the prefill
            return original(*args, **kwargs)
        masks.append(kwargs["attention_mask"])
        with profile() as prof:
            out = original(*args, **kwargs)
        converted.extend(e.name for e in prof.events() if e.name in ("aten::where", "aten::scalar_tensor"))
        return out

    monkeypatch.setattr(model, "forward", forward)
    loop = hf.decode_static if static else hf.decode
    args = (enc["input_ids"], enc["attention_mask"], SamplingParams(temperature=0, max_new_tokens=5), None, 0)
    with torch.inference_mode():
        loop(model, *args)
    assert len(masks) == 4 and not converted, converted
    for mask in masks:
        assert mask.dtype == model.dtype and mask.dim() == 4 and mask.stride(-1) == 1
        assert all(stride % hf.MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1]), mask.stride()
        assert torch.isin(mask, torch.tensor([0.0, torch.finfo(mask.dtype).min])).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_on_a_gpu_the_decode_loop_asks_every_4_steps_reads_late_and_returns_the_same(trained, monkeypatch, static):
    """On a GPU "have all rows ended?" is asked every 4 steps and each answer read at the next ask (a read at once
    would stall the host until the GPU caught up); the columns decoded past the last row's end are cut, so the tokens
    and the width equal reading every step, and at most 7 steps more are decoded."""
    from alignpipe.engine import hf

    model, tok = trained
    enc = tok(["The film", "I watched it and", "A", "Honestly, the plot was"], return_tensors="pt", padding=True)
    loop = hf.decode_static if static else hf.decode
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)

    def run(every: int, late: bool) -> tuple[torch.Tensor, int, int]:
        monkeypatch.setattr(hf, "check_every", lambda device: every)
        monkeypatch.setattr(hf, "late_reads", lambda device: late)
        reads, forwards = [], []
        original = torch.Tensor.__bool__
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or original(t))
        hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
        args = (model, enc["input_ids"], enc["attention_mask"], sampling, tok.eos_token_id, tok.pad_token_id)
        try:
            with torch.inference_mode():
                out, _ = loop(*args, torch.Generator().manual_seed(5), n=2)
        finally:
            monkeypatch.setattr(torch.Tensor, "__bool__", original)
            hook.remove()
        return out, len(reads), len(forwards)

    every_step, reads_1, forwards_1 = run(1, late=False)
    every_4, reads_4, forwards_4 = run(4, late=True)
    assert torch.equal(every_4, every_step) and every_step.size(1) < 20, "rows ended early, and alike"
    assert 2 * reads_4 <= reads_1, (reads_4, reads_1)
    assert 0 < forwards_4 - forwards_1 <= 7, (forwards_1, forwards_4)


def test_row_ends_read_late_stop_at_the_check_after_the_one_that_saw_every_row_end(monkeypatch):
    """One row ends at step 3, the others at step 5; asked every 4 steps, the ask after step 7 is the first to see
    them all ended. Read late, the ask after step 11 reads that answer and stops; read at once, the ask after step 7
    stops. The width, worked out from the tokens (`ended_width`), is 6 either way."""
    from alignpipe.engine import hf

    monkeypatch.setattr(hf, "check_every", lambda device: 4)
    stops, eos, pad = {}, torch.tensor([2]), 0
    for late in (False, True):
        monkeypatch.setattr(hf, "late_reads", lambda device, late=late: late)
        ends = hf.RowEnds(rows=3, steps=32, device=torch.device("cpu"))
        new = torch.full((3, 32), pad)
        for t in range(32):
            token = torch.tensor({3: [2, 9, 9], 5: [9, 2, 2]}.get(t, [9, 9, 9]))
            new[:, t] = token.masked_fill(ends.done, pad)  # as `Sampled.add` records it: pad after a row's end
            ends.record(new[:, t], eos)
            if ends.finished(t):
                stops[late] = (t, hf.ended_width(new, eos))
                break
    assert stops == {False: (7, 6), True: (11, 6)}


def test_the_ended_width_is_the_last_row_s_first_stop_token_whatever_comes_after():
    """`ended_width` reads each row's end from its tokens: its first stop token, also where the padding after it is
    itself a stop token (EOS as pad); a row with none keeps every column."""
    from alignpipe.engine.hf import ended_width

    eos = torch.tensor([2, 7])
    new = torch.tensor([[5, 2, 2, 2, 2, 2], [5, 5, 5, 7, 2, 2], [5, 5, 5, 5, 5, 5]])
    assert ended_width(new[:2], eos) == 4 and ended_width(new, eos) == 6 and ended_width(new, None) == 6
    assert ended_width(new[:1], eos) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_reward_model_scores_in_the_dtype_it_was_saved_in(tiny, tmp_path, dtype):
    """A reward model scores in its checkpoint's dtype (a bf16 reward stage's model in bf16), with the scores the
    classifier itself gives prompt + completion + EOS."""
    from alignpipe.judges.reward_model import RewardModelScorer
    from alignpipe.modeling import load_sequence_scorer

    tok = load_tokenizer(str(tiny / "model"))
    model = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id, seed=0).to(dtype)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), device="cpu")
    assert scorer.model.dtype == dtype
    got = scorer(["good", "a bad"], [" day", " film"])
    with torch.no_grad():
        want = [
            float(model(**tok(t + tok.eos_token, return_tensors="pt")).logits[0, 0]) for t in ("good day", "a bad film")
        ]
    assert got == pytest.approx(want, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("attention", ["varlen", "flash_attention_2"])
def test_a_reward_model_on_a_document_kernel_scores_padding_free_as_padded(tiny, monkeypatch, attention):
    """On a kernel that runs documents (what `auto` picks on a GPU), the scorer runs a batch as one row of real
    tokens; on `varlen` the completions of one prompt (GRPO's group) share their common token prefix, run once. The
    scores equal the padded batch's through SDPA. (flash-attn's kernel itself needs CUDA: its layout, every text its
    own document, runs here through `varlen`'s exact per-document path.)"""
    from alignpipe.judges import reward_model
    from alignpipe.judges.reward_model import RewardModelScorer
    from alignpipe.modeling import implementation

    scorer = RewardModelScorer(str(tiny / "model"), batch_size=5, device="cpu")
    torch.manual_seed(0)
    torch.nn.init.normal_(scorer.model.score.weight, std=0.5)
    prompts = ["The film was", "The film was", "The film was", "I watched it and", "I watched it and", "A"]
    completions = [" great", " dull and long", " ok", " left", " loved every minute", " fine"]
    padded = scorer(prompts, completions)
    layouts = []
    scores = reward_model.classifier_scores
    monkeypatch.setattr(
        reward_model, "classifier_scores", lambda m, packed: layouts.append(packed) or scores(m, packed)
    )
    if attention == "flash_attention_2":  # its layout, run by our varlen forward (flash-attn needs CUDA)
        monkeypatch.setattr(reward_model, "layout", lambda model: "documents")
    scorer.model.set_attn_implementation(implementation("varlen"))
    assert scorer(prompts, completions) == pytest.approx(padded, abs=1e-5)
    texts = sum(len(scorer.tok(p + c + scorer.tok.eos_token)["input_ids"]) for p, c in zip(prompts, completions))
    assert len(layouts) == 2, "batches of 5 and 1"
    ran = sum(p["input_ids"].size(1) for p in layouts)
    if attention == "varlen":
        assert "key_rows" in layouts[0]["documents"] and ran < texts, (ran, texts)
    else:
        assert "key_rows" not in layouts[0]["documents"] and ran == texts


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampling_logprobs_are_those_of_the_distribution_each_token_was_drawn_from(trained, static, top_k):
    """Asked for, the engine returns each kept token's log-prob under what it sampled from: the model's softmax at
    the temperature, renormalised over the top-k tokens when filtered (vLLM's "processed" logprobs), computed here
    again with a full forward. The tokens are the ones drawn without asking, and the list is as long as the ids
    (rows that ended early included)."""
    from alignpipe.engine.hf import filter_logits

    model, tok = trained
    prompts = ["The film", "I watched it and", "A", "Honestly, the plot was"]
    sampling = SamplingParams(temperature=0.7, top_k=top_k, max_new_tokens=12)
    engine = HFEngine(model, tok, 8, static_cache=static)
    plain = engine.generate(prompts, 2, sampling, seed=4)
    gens = engine.generate(prompts, 2, sampling, seed=4, logprobs=True)
    assert [g.completion_ids for g in gens] == [g.completion_ids for g in plain] and plain[0].logprobs is None
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    for g in gens:
        assert len(known(g.logprobs)) == len(g.completion_ids)

        prompt = tok(prompts[g.prompt_index])["input_ids"]
        ids = torch.tensor([prompt + g.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = filter_logits(logits, sampling).log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4), (g.logprobs, expected)


def test_the_vllm_server_engine_refuses_to_give_sampling_logprobs_from_a_raw_server():
    """A server's log-probs follow its own `--logprobs-mode` (raw by default), not what was sampled from."""
    from alignpipe.engine.vllm import VLLMServerEngine

    with pytest.raises(ValueError, match="started with `--logprobs-mode processed_logprobs`"):
        VLLMServerEngine("http://127.0.0.1:9", tokenizer=None).generate(["a"], logprobs=True)
