"""Recipe errors that say what is wrong, where in the recipe, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field


def format_path(path: tuple) -> str:
    """`("stages", 1, "lr")` → `stages[1].lr`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<recipe>"


@dataclass
class Problem:
    """One thing wrong with a recipe."""

    path: tuple
    message: str
    hint: str = ""
    line: int | None = None
    label: str = field(default="", compare=False)  # e.g. "stage 'sft'", shown next to the path
    override: str = ""
    """The `--set KEY=VALUE` that put the bad value there (then it is named instead of a line of the file)."""
    kind: str = field(default="", compare=False)
    """A field problem's pydantic error type (`greater_than`, `extra_forbidden`, …); empty for the graph and data checks'."""
    secret: bool = field(default=False, compare=False)
    """The bad value may be a credential pasted in the wrong place: an override that wrote it is named without it."""

    def render(self) -> str:
        where = format_path(self.path)
        if self.label:
            where += f" ({self.label})"
        if self.override:
            shown = self.override.split("=", 1)[0] + "=…" if self.secret else self.override
            where += f", from --set {shown}"
        elif self.line is not None:
            where += f", line {self.line}"
        text = f"  - {where}: {self.message}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


class RecipeError(Exception):
    """Raised for any invalid recipe; `str()` lists every problem found, each with a fix."""

    exit_code = 2

    def __init__(self, problems: list[Problem], source: str = "recipe"):
        self.problems = problems
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source} is invalid ({n} problem{'s' if n != 1 else ''}):"
        return "\n".join([head, *(p.render() for p in self.problems)])
