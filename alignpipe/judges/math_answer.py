"""The `math_answer` reward: is the final answer of a worked solution right?

Math RL data (GSM8K, MATH, NuminaMath...) gives a reference answer per problem while the policy writes a derivation.
Comparing the whole completion with `exact_match` never pays, so this reward extracts the answer the completion
commits to and compares it with the reference's, as numbers where both are numbers (`1,000` = `1000.0`,
`\\frac{3}{4}` = `0.75`, exactly, with fractions) and as normalised LaTeX-ish strings otherwise.
It needs no extra dependency; for symbolic equivalence (`2\\sqrt{2}` = `\\sqrt{8}`) pass a `module:function` of
your own (e.g. wrapping `math_verify`).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_HASHES = re.compile(r"####\s*([^\n]*)")
_SAYS = re.compile(r"\banswer(?:\s+is\b|\s*[:=])\s*:?\s*([^\n]*)", re.I)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$")
_VARIABLE = re.compile(r"^[a-zA-Z]\s*=\s*(?=\S)")


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces balance (nested braces kept)."""
    for start in reversed([m.end() for m in _BOXED.finditer(text)]):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1]
    return None


def _first_number_or_all(piece: str) -> str:
    found = _NUMBER.search(piece)
    return found.group(0) if found else piece


def marked_answer(text: str) -> str | None:
    """The answer `text` commits to, by the first of these it has: the last `\\boxed{}`, the last
    `<answer>...</answer>`, the last `#### ...` line (GSM8K), the last "answer is ..."; None when it marks none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    tags = _TAG.findall(text)
    if tags:
        return _last_boxed(tags[-1]) or tags[-1]
    for pattern in (_HASHES, _SAYS):
        lines = pattern.findall(text)
        if lines:
            return _first_number_or_all(lines[-1])
    return None


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalise(answer: str) -> str:
    """Drop what does not change an answer: `$`, `\\left`/`\\right`, spacing commands, `\\text{}` wrappers, a leading
    `x =`, degree and percent signs, a final full stop, whitespace; `\\dfrac`/`\\tfrac` → `\\frac`."""
    s = answer.strip()
    s = _TEXT.sub(r"\1", s)
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _VARIABLE.sub("", s.strip())
    return "".join(s.split()).rstrip(".")


def as_number(answer: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number (`1,234.5`, `-3/4`, `\\frac{3}{4}`), else None."""
    frac = _FRAC.match(answer)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", answer):
        answer = answer.replace(",", "")
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Equal as exact numbers when both are numbers, else equal as normalised strings."""
    p, r = normalise(predicted), normalise(reference)
    pn, rn = as_number(p), as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r and p != ""


def math_answer(prompts, completions, answer=None, last_number_fallback=True, **_) -> list[float | None]:
    """1.0 when the completion's final answer equals the `answer` column's, else 0.0; None for a row without one.

    The completion's answer is the one it marks (see `marked_answer`), else, with `last_number_fallback`, its last
    number. The reference is the answer the `answer` column marks (GSM8K's `#### 72`, a solution's `\\boxed{}`), else
    the whole column (`72`, `\\frac{14}{3}`)."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, ref in zip(completions, answer):
        if ref is None or not str(ref).strip():
            out.append(None)
            continue
        reference = marked_answer(str(ref)) or str(ref)
        predicted = marked_answer(completion)
        if predicted is None and last_number_fallback:
            predicted = last_number(completion)
        out.append(1.0 if predicted is not None and answers_equal(predicted, reference) else 0.0)
    return out
