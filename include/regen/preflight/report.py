"""What preflight found: every problem, one line each, and what the later stages read."""

from __future__ import annotations

from dataclasses import dataclass, field

from regen.errors import RegenError


class PreflightFailed(RegenError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"preflight found {len(problems)} problem(s):\n" + "\n".join(problems))

    def detail(self) -> dict:
        return {"problems": self.problems}

    @classmethod
    def from_detail(cls, message: str, detail: dict) -> "PreflightFailed":
        return cls(list(detail.get("problems") or [message]))


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems
