"""What preflight found: every problem, one line each, and what the later stages read."""

from __future__ import annotations

from dataclasses import dataclass, field

from regen.errors import RegenError


class PreflightFailed(RegenError):
    """``held_by``: the run holding the output, when that is what failed (the DAG asks Airflow
    whether it has ended)."""

    def __init__(self, problems: list[str], held_by: str | None = None):
        self.problems, self.held_by = problems, held_by
        super().__init__(f"preflight found {len(problems)} problem(s):\n" + "\n".join(problems))

    def detail(self) -> dict:
        return {"problems": self.problems, "held_by": self.held_by}

    @classmethod
    def from_detail(cls, message: str, detail: dict) -> "PreflightFailed":
        return cls(list(detail.get("problems") or [message]), detail.get("held_by"))


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems
