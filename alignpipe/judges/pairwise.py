"""Pairwise LLM judging: a judge model sees the prompt and two responses and names the better one.

Each pair is judged twice, with the responses in both orders, to cancel position bias; when the two
verdicts disagree (or either cannot be read) the pair is a tie. The judge is a local transformers model
(greedy decoding) or any OpenAI-compatible chat endpoint (e.g. `vllm serve`).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from alignpipe.judges.http_endpoints import auth_headers, json_with_retries

DEFAULT_TEMPLATE = (
    "You are comparing two responses to the same prompt.\n\nPrompt:\n{prompt}\n\n"
    "Response A:\n{response_a}\n\nResponse B:\n{response_b}\n\n"
    "Which response is better? Answer with a single letter: A or B.\nAnswer:"
)
_VERDICT = re.compile(r"\b([AB])\b")
log = logging.getLogger(__name__)


def parse_verdict(text: str) -> str | None:
    """'A', 'B', or None when the judge's answer names neither (first standalone letter wins)."""
    m = _VERDICT.search(text.strip())
    return m.group(1) if m else None


def combine(first: str | None, swapped: str | None) -> str:
    """Verdict for (candidate=A, baseline=B) from the normal and the swapped judgement: win / loss / tie."""
    if first == "A" and swapped == "B":
        return "win"
    if first == "B" and swapped == "A":
        return "loss"
    return "tie"


class LocalJudge:
    """A transformers causal LM as judge (greedy). With `chat_template` and a tokenizer that has one, each filled
    template is sent as a user turn, as an endpoint's server does with a chat request: an instruct judge answers
    the question it was trained to answer, not a continuation of raw text."""

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 8,
        batch_size: int = 16,
        chat_template: bool = True,
        name: str = "",
        template_kwargs: dict | None = None,
    ):
        from alignpipe.engine.hf import HFEngine
        from alignpipe.positions import model_position_limit

        self.engine = HFEngine(model, tokenizer, batch_size)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.chat = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.position_limit = model_position_limit(model)
        self.name = name or "LLM judge"
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, prompt: str) -> str:
        if not self.chat:
            return prompt
        turn = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(
            turn, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )

    def __call__(self, prompts: list[str]) -> list[str]:
        from alignpipe.engine.sampling import SamplingParams
        from alignpipe.positions import check_generation_window

        rendered = [self.render(p) for p in prompts]
        check_generation_window(
            self.position_limit,
            self.tokenizer,
            rendered,
            self.max_new_tokens,
            self.name,
            "llm_judge.max_new_tokens",
            "keep the judged prompts and completions shorter (the judge reads both completions and its template, "
            "{n} tokens in all)",
        )
        gens = self.engine.generate(rendered, 1, SamplingParams(temperature=0, max_new_tokens=self.max_new_tokens))
        return [g.completion for g in gens]


def server_root(url: str) -> str:
    """An OpenAI-compatible server's root, to which /v1/... is appended: `https://api.openai.com/v1` (the form
    OpenAI's clients take) and `https://api.openai.com` name the same server."""
    root = url.rstrip("/")
    return root.removesuffix("/v1")


class EndpointJudge:
    """An OpenAI-compatible `/v1/chat/completions` endpoint as judge (temperature 0)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        max_new_tokens: int = 8,
        timeout_s: float = 120.0,
        retries: int = 3,
        template_kwargs: dict | None = None,
        api_key: str | None = None,
        concurrency: int = 16,
        progress: str | None = None,
    ):
        self.base, self.model, self.max_new_tokens = server_root(base_url), model, max_new_tokens
        self.timeout_s, self.retries, self.concurrency = timeout_s, retries, concurrency
        self.progress = progress  # a bar's label for each call (the judge stage's); None: no bar (online DPO's steps)
        self.template_kwargs = dict(template_kwargs or {})  # sent as vLLM's `chat_template_kwargs` when given
        self._headers = auth_headers(api_key)  # never in an error, a log or a repr
        # what each request asks besides the messages; `_adapt` rewrites it where the server refuses a field
        self.sampling: dict[str, Any] = {"temperature": 0, "max_tokens": max_new_tokens}
        self._adapting = threading.Lock()

    def _request(self, client, method: str, path: str, **kwargs):
        return json_with_retries(
            lambda: client.request(method, f"{self.base}{path}", **kwargs),
            f"LLM judge {self.base}{path}",
            self.retries,
            self.timeout_s,
        )

    def __call__(self, prompts: list[str]) -> list[str]:
        """The judge's answer to each prompt, in order; up to `concurrency` requests in flight, so that a server
        batches them (vLLM) instead of decoding one at a time."""
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        from alignpipe.progress import progress

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        with httpx.Client(timeout=self.timeout_s, headers=self._headers, limits=limits) as client:
            if self.model is None:
                listed = self._request(client, "GET", "/v1/models").get("data") or []
                if not listed:
                    raise RuntimeError(
                        f"LLM judge {self.base}/v1/models lists no model: set llm_judge.served_model to the one to ask"
                    )
                self.model = listed[0]["id"]
            bar = progress(len(prompts), self.progress) if self.progress else None
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="judge") as pool:
                out = []
                for answer in pool.map(lambda p: self._ask(client, p), prompts):
                    out.append(answer)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        return out

    def _ask(self, client, prompt: str) -> str:
        for _ in range(len(ADAPTED) + 1):
            body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
            body |= self.sampling
            if self.template_kwargs:
                body["chat_template_kwargs"] = self.template_kwargs
            try:
                answer = self._request(client, "POST", "/v1/chat/completions", json=body)
            except RuntimeError as e:
                if not self._adapt(e.__cause__, body):
                    raise
                continue
            return answer["choices"][0]["message"]["content"] or ""
        raise AssertionError("unreachable: each field is adapted once")

    def _adapt(self, cause, sent: dict) -> bool:
        """Whether the server's 400 refused a sampling field this judge can do without, now rewritten for every later
        request: OpenAI's reasoning models refuse `max_tokens` (they take `max_completion_tokens`) and any
        `temperature` but their default, saying so in the error's `param` and `code`."""
        import httpx

        if not isinstance(cause, httpx.HTTPStatusError) or cause.response.status_code != 400:
            return False
        try:
            error = cause.response.json().get("error") or {}
        except ValueError:
            return False
        param = error.get("param") if isinstance(error, dict) else None
        if (
            param not in ADAPTED
            or param not in sent
            or error.get("code") not in ("unsupported_parameter", "unsupported_value")
        ):
            return False
        with self._adapting:
            if param in self.sampling:  # another request may have adapted it already
                value, instead = self.sampling.pop(param), ADAPTED[param]
                if instead:
                    self.sampling[instead] = value
                log.info(
                    "LLM judge %s refused %s (%s); %s",
                    self.base,
                    param,
                    error.get("code"),
                    f"sending {instead} instead" if instead else "leaving it to the server's default",
                )
        return True


ADAPTED: dict[str, str | None] = {"max_tokens": "max_completion_tokens", "temperature": None}
"""Sampling fields an endpoint may refuse (`error.param`), and what is sent instead (None: nothing)."""


def judge_pairs(judge, template: str, prompts: list[str], candidate: list[str], baseline: list[str]) -> list[dict]:
    """Both orders per pair; returns one record per prompt with both raw answers and the verdict."""
    forward = [template.format(prompt=p, response_a=c, response_b=b) for p, c, b in zip(prompts, candidate, baseline)]
    swapped = [template.format(prompt=p, response_a=b, response_b=c) for p, c, b in zip(prompts, candidate, baseline)]
    answers = judge(forward + swapped)
    n = len(prompts)
    records = []
    for i in range(n):
        first, second = parse_verdict(answers[i]), parse_verdict(answers[n + i])
        records.append(
            {
                "judge_forward": answers[i],
                "judge_swapped": answers[n + i],
                "verdict": combine(first, second),
                "unreadable": (first is None) + (second is None),
            }
        )
    return records


UNREADABLE_WARN = 0.1
"""A judge whose answers name neither letter more often than this is warned about: its ties are not verdicts."""


def unreadable_rate(records: list[dict], judge_name: str, pair: str, log) -> float:
    """The share of a pair's judgements (two a prompt) whose answer named neither A nor B. All of them: an error (the
    win rate would be 0.5 by construction); over `UNREADABLE_WARN`: a warning. Either names the likely causes."""
    rate = sum(r["unreadable"] for r in records) / (2 * len(records))
    causes = (
        "raise llm_judge.max_new_tokens (a reasoning model spends them thinking first), set "
        "llm_judge.chat_template_kwargs {enable_thinking: false} for a thinking model, or make the template ask for "
        "the single letter"
    )
    if rate == 1.0:
        raise ValueError(
            f"{judge_name} named neither A nor B in any of its {2 * len(records)} answers for {pair} (the first: "
            f"{records[0]['judge_forward'][:200]!r}), so nothing was judged: {causes}"
        )
    if rate > UNREADABLE_WARN:
        log.warning(
            "%s named neither A nor B in %.0f%% of its answers for %s; those pairs count as ties: %s",
            judge_name,
            100 * rate,
            pair,
            causes,
        )
    return rate
