"""The `when:` condition language: parsed (never eval'd), explained, strict about unknown metrics."""

import pytest

from alignpipe.gates import GateError, evaluate, parse, stages_in

METRICS = {
    "judge": {"judge/win_rate": 0.62, "judge/ci_low": 0.48, "judge/sft_vs_base/win_rate": 0.7},
    "judge-rm": {"judge/win_rate": 0.3},
    "dpo": {"eval/loss": 0.9},
}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("judge.win_rate >= 0.55", True),
        ("judge.win_rate >= 0.55 and judge.ci_low > 0.5", False),
        ("judge.win_rate >= 0.55 and judge.ci_low > 0.5 or dpo.eval/loss < 1", True),
        ("not (judge-rm.win_rate < 0.4)", False),
        ("judge.sft_vs_base/win_rate > judge.win_rate", True),
        ("(judge.win_rate > 0.6) and (judge-rm.win_rate != 0.3)", False),
    ],
)
def test_conditions_evaluate(text, expected):
    assert evaluate(parse(text), METRICS)[0] is expected


def test_explanation_lists_each_comparison():
    ok, why = evaluate(parse("judge.win_rate >= 0.55 and judge.ci_low > 0.5"), METRICS)
    assert not ok and why == "judge.win_rate = 0.62 >= 0.55 → true; judge.ci_low = 0.48 > 0.5 → false"


@pytest.mark.parametrize(
    "text",
    [
        "judge.win_rate >=",
        "__import__('os').system('rm')",
        "win_rate > 0.5",
        "judge.x > 1 1",
        "judge.win_rate >= 0.5 and",
        "(judge.win_rate > 1",
    ],
)
def test_bad_conditions_are_refused(text):
    with pytest.raises(GateError):
        parse(text)


def test_unknown_metric_names_what_exists():
    with pytest.raises(GateError, match="has no metric 'accuracy'; it has: judge/ci_low"):
        evaluate(parse("judge.accuracy > 0.5"), METRICS)
    assert stages_in(parse("judge.win_rate > 0.5 or judge-rm.win_rate > 0.5")) == {"judge", "judge-rm"}
