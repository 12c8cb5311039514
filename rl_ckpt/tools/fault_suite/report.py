"""The suite's results: violations per scenario, the report table and its JSON."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Violation:
    scenario: str
    variant: str
    case: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"[{self.scenario} {self.variant}] {self.case}: {self.kind}: {self.message}"


@dataclasses.dataclass
class ScenarioResult:
    key: str
    title: str
    tried: int = 0
    injected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    corrupt_loads: int = 0
    acked_lost: int = 0
    broken_listed: int = 0
    corruptions_injected: int = 0
    corruptions_detected: int = 0
    escapes: int = 0
    max_rolled_back: int = 0
    violations: list[Violation] = dataclasses.field(default_factory=list)
    notes: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    COUNTERS = {
        "corrupt_load": "corrupt_loads",
        "acked_lost": "acked_lost",
        "broken_listed": "broken_listed",
        "escape": "escapes",
    }

    @property
    def ok(self) -> bool:
        return not self.violations

    def violate(self, variant: str, case: str, kind: str, message: str, count: int = 1) -> None:
        attr = self.COUNTERS.get(kind)
        if attr:
            setattr(self, attr, getattr(self, attr) + count)
        self.violations.append(Violation(self.key, variant, case, kind, message[:600]))

    def note(self, key: str, n: int = 1) -> None:
        self.notes[key] = self.notes.get(key, 0) + n

    def merge(self, other: "ScenarioResult") -> None:
        for attr in (
            "tried",
            "corrupt_loads",
            "acked_lost",
            "broken_listed",
            "corruptions_injected",
            "corruptions_detected",
            "escapes",
        ):
            setattr(self, attr, getattr(self, attr) + getattr(other, attr))
        self.injected.update(other.injected)
        self.max_rolled_back = max(self.max_rolled_back, other.max_rolled_back)
        self.violations += other.violations
        for key, value in other.notes.items():
            if isinstance(value, int) and isinstance(self.notes.get(key, 0), int):
                self.notes[key] = self.notes.get(key, 0) + value
            else:
                self.notes[key] = value

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["injected"] = dict(self.injected)
        d["faults_injected"] = sum(self.injected.values())
        d["violations"] = [dataclasses.asdict(v) for v in self.violations]
        d["ok"] = self.ok
        d["seconds"] = round(self.seconds, 1)
        return d


@dataclasses.dataclass
class SuiteReport:
    mode: str
    started: str
    machine: dict
    scenarios: list[ScenarioResult]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.scenarios)

    def get(self, key: str) -> ScenarioResult:
        return next(s for s in self.scenarios if s.key == key)

    @property
    def violations(self) -> list[Violation]:
        return [v for s in self.scenarios for v in s.violations]

    def totals(self) -> dict:
        out = {
            k: sum(getattr(s, k) for s in self.scenarios)
            for k in (
                "tried",
                "corrupt_loads",
                "acked_lost",
                "broken_listed",
                "corruptions_injected",
                "corruptions_detected",
                "escapes",
            )
        }
        out["faults_injected"] = sum(sum(s.injected.values()) for s in self.scenarios)
        out["max_rolled_back"] = max((s.max_rolled_back for s in self.scenarios), default=0)
        out["violations"] = len(self.violations)
        return out

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "started": self.started,
            "machine": self.machine,
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
            "totals": self.totals(),
            "scenarios": [s.to_json() for s in self.scenarios],
        }

    def table(self) -> str:
        head = [
            "scenario",
            "tried",
            "faults",
            "corrupt loads",
            "acked lost",
            "broken listed",
            "detected/injected",
            "escapes",
            "max rollback",
            "violations",
            "time",
        ]
        rows = []
        for s in self.scenarios:
            det = f"{s.corruptions_detected}/{s.corruptions_injected}" if s.corruptions_injected else "-"
            rows.append(
                [
                    s.key,
                    str(s.tried),
                    str(sum(s.injected.values())),
                    str(s.corrupt_loads),
                    str(s.acked_lost),
                    str(s.broken_listed),
                    det,
                    str(s.escapes),
                    str(s.max_rolled_back),
                    str(len(s.violations)),
                    f"{s.seconds:.0f}s",
                ]
            )
        t = self.totals()
        det = f"{t['corruptions_detected']}/{t['corruptions_injected']}"
        rows.append(
            [
                "TOTAL",
                str(t["tried"]),
                str(t["faults_injected"]),
                str(t["corrupt_loads"]),
                str(t["acked_lost"]),
                str(t["broken_listed"]),
                det,
                str(t["escapes"]),
                str(t["max_rolled_back"]),
                str(t["violations"]),
                f"{self.seconds:.0f}s",
            ]
        )
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

        def line(cells):
            return (
                "| "
                + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                + " |"
            )

        out = [
            line(head),
            "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|",
        ]
        out += [line(r) for r in rows]
        out.append("")
        out.append("Faults injected, by kind:")
        for s in self.scenarios:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s.injected.items()))
            out.append(f"  {s.key}: {kinds or '-'}")
        out.append("")
        out.append("Other figures:")
        for s in self.scenarios:
            if s.notes:
                out.append(f"  {s.key}: " + ", ".join(f"{k} {v}" for k, v in s.notes.items()))
        if self.violations:
            out.append("")
            out.append(f"VIOLATIONS ({len(self.violations)}):")
            out += [f"  {v}" for v in self.violations[:40]]
            if len(self.violations) > 40:
                out.append(f"  ... {len(self.violations) - 40} more (see --json)")
        out.append("")
        out.append(
            f"{'OK' if self.ok else 'FAILED'}: {self.mode} suite, {t['tried']} cases, {self.seconds:.0f}s "
            f"on {self.machine['cpus']} cores"
        )
        return "\n".join(out)


# -- targets: where a case's run lives, and how to look at it -----------------------------------
