"""Bad rows counted by reason, for prepare's and jobs.predict's summaries and refusals.

A problem is one line, `<where>: <what>` (`rows.csv row 2: image '/data/x.png': cannot read
(...)`, `chats.jsonl:4: not JSON (...)`). Its reason is the line without where it is and without
the row's own values: quoted values (but a column's name) and numbers masked, so that 7,059
pictures that cannot be read count as one reason, whatever their paths. The first problem of
each reason is kept whole as its example. No Ray, nothing but strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SHOWN = 300  # characters of a value (a path) a problem shows: its whole, or its tail
_WHERE = re.compile(r"^.*?(?: row \d+|:\d+): ")
_QUOTED = re.compile(r"""(columns? )?('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,.]*(?:e[+-]?\d+)?(?![\w])")


def shown(value: str) -> str:
    """A value as a problem names it: `repr` of it whole, or of its tail past SHOWN characters
    (the end of a path says which file)."""
    return repr(value if len(value) <= SHOWN else "..." + value[-(SHOWN - 3) :])


def reason_of(problem: str) -> str:
    """What a problem says without where it is and the row's own values."""
    what = _WHERE.sub("", problem, count=1)
    kept = _QUOTED.sub(lambda m: m.group(0) if m.group(1) else "'...'", what)  # a column's name
    return _NUMBER.sub("N", kept)


@dataclass
class Reasons:
    """Rows per reason, and each reason's first problem, in the order first met."""

    rows: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, problem: str, rows: int = 1, example: str | None = None) -> None:
        """`rows` rows refused for `problem`; `example` shows the first (default: itself)."""
        reason = reason_of(problem)
        self.rows[reason] = self.rows.get(reason, 0) + rows
        self.first.setdefault(reason, example or problem)

    def merge(self, other: Reasons) -> None:
        for reason, rows in other.rows.items():
            self.rows[reason] = self.rows.get(reason, 0) + rows
            self.first.setdefault(reason, other.first[reason])

    def total(self) -> int:
        return sum(self.rows.values())

    def as_list(self) -> list[dict[str, object]]:
        """The summary's form: each reason, its rows and its first problem, most rows first."""
        order = sorted(self.rows, key=lambda r: -self.rows[r])
        return [{"reason": r, "rows": self.rows[r], "first": self.first[r]} for r in order]

    def line(self) -> str:
        """`7,059 image '...': cannot read (...) (first: <problem>); 3 ...`"""
        return "; ".join(
            f"{r['rows']:,} {r['reason']} (first: {r['first']})" for r in self.as_list()
        )
