"""Promotion gates: `when:` conditions on upstream metrics, in a small language that is parsed, never eval'd.

    when: judge.win_rate >= 0.55 and judge.ci_low > 0.5
    when: not (dpo.eval/loss > 1.0) or judge-rm.win_rate >= 0.6

Grammar:   expr := and ('or' and)* ;  and := not ('and' not)* ;  not := 'not' not | cmp
           cmp  := atom (('<' | '<=' | '>' | '>=' | '==' | '!=') atom)? ;  atom := NUMBER | REF | '(' expr ')'
A REF is `<stage id>.<metric>`; the metric is looked up in the stage's manifest as given, then as the
shallowest `<namespace>/<metric>` (so `judge.win_rate` finds `judge/win_rate`, and
`judge.sft_vs_base/win_rate` a per-pair rate).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"\s*(?:(?P<num>-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)|(?P<op><=|>=|==|!=|<|>|\(|\))|"
    r"(?P<word>[A-Za-z][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_/.-]+)?))"
)
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


class GateError(ValueError):
    pass


@dataclass
class Ref:
    stage: str
    metric: str


def _tokens(text: str) -> list[tuple[str, str]]:
    pos, out = 0, []
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise GateError(f"cannot read {text[pos:].strip()[:20]!r} at column {pos + 1}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        if kind == "word" and value in ("and", "or", "not"):
            kind = value
        elif kind == "word" and "." not in value:
            raise GateError(f"{value!r} is not a metric reference; write <stage id>.<metric>, e.g. judge.win_rate")
        out.append((kind, value))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            want = value or kind or "more input"
            raise GateError(f"expected {want!r} but found {tok[1] or 'the end'!r}")
        self.i += 1
        return tok

    def parse(self):
        node = self.expr()
        if self.peek()[0] is not None:
            raise GateError(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self):
        node = self.conj()
        while self.peek()[0] == "or":
            self.take()
            node = ("or", node, self.conj())
        return node

    def conj(self):
        node = self.neg()
        while self.peek()[0] == "and":
            self.take()
            node = ("and", node, self.neg())
        return node

    def neg(self):
        if self.peek()[0] == "not":
            self.take()
            return ("not", self.neg())
        return self.cmp()

    def cmp(self):
        left = self.atom()
        if self.peek()[0] == "op" and self.peek()[1] in _OPS:
            op = self.take()[1]
            return ("cmp", op, left, self.atom())
        return left

    def atom(self):
        kind, value = self.peek()
        if kind == "num":
            self.take()
            return ("num", float(value))
        if kind == "word":
            self.take()
            stage, metric = value.split(".", 1)
            return ("ref", Ref(stage, metric))
        if kind == "op" and value == "(":
            self.take()
            node = self.expr()
            self.take("op", ")")
            return node
        raise GateError(f"expected a number, a metric or '(' but found {value or 'the end'!r}")


def parse(text: str):
    """Parse a condition; raises GateError with what is wrong."""
    return _Parser(text).parse()


def refs_in(node) -> list[Ref]:
    """The metric references of a parsed condition, in the order they are written."""
    if node[0] == "ref":
        return [node[1]]
    if node[0] == "num":
        return []
    return [ref for n in node[1:] if isinstance(n, tuple) for ref in refs_in(n)]


def stages_in(node) -> set[str]:
    return {ref.stage for ref in refs_in(node)}


def lookup(metrics: dict[str, dict[str, float]], ref: Ref) -> float:
    values = metrics.get(ref.stage)
    if values is None:
        raise GateError(f"stage {ref.stage!r} has no metrics (did it run?)")
    if ref.metric in values:
        return values[ref.metric]
    matches = [k for k in values if k.endswith("/" + ref.metric)]
    if matches:  # the shallowest key wins: judge.win_rate → judge/win_rate, not judge/a_vs_b/win_rate
        depth = min(k.count("/") for k in matches)
        shallow = [k for k in matches if k.count("/") == depth]
        if len(shallow) == 1:
            return values[shallow[0]]
    raise GateError(f"stage {ref.stage!r} has no metric {ref.metric!r}; it has: {', '.join(sorted(values))}")


def evaluate(node, metrics: dict[str, dict[str, float]]) -> tuple[bool, str]:
    """(result, explanation with every compared value), e.g. `judge.win_rate = 0.52 >= 0.55 → false`."""
    notes: list[str] = []

    def value(n):
        if n[0] == "num":
            return n[1]
        if n[0] == "ref":
            return lookup(metrics, n[1])
        return truth(n)

    def name(n):
        return f"{n[1].stage}.{n[1].metric}" if n[0] == "ref" else (f"{n[1]:g}" if n[0] == "num" else "(…)")

    def truth(n) -> bool:
        kind = n[0]
        if kind == "or":
            return truth(n[1]) or truth(n[2])
        if kind == "and":
            return truth(n[1]) and truth(n[2])
        if kind == "not":
            return not truth(n[1])
        if kind == "cmp":
            a, b = value(n[2]), value(n[3])
            result = _OPS[n[1]](a, b)
            notes.append(
                f"{name(n[2])} = {a:.4g} {n[1]} {name(n[3])}{'' if n[3][0] == 'num' else f' = {b:.4g}'} → {str(result).lower()}"
            )
            return result
        if kind in ("ref", "num"):
            return bool(value(n))
        raise GateError(f"bad node {kind}")

    result = truth(node)
    return result, "; ".join(notes)
