"""SEAgent's curriculum generator on the synthetic desk (Eq. 1, App. C): after each phase it updates a
software guidebook U and the task set I from the judge's results, offline, from the desk's own task
families instead of a large language model.

    (U_{p+1}, I_{p+1}) = M_task(U_p, I_p, J_p)

* The guidebook holds, per desk family, the judged outcomes so far, the errors the judge named, and whether the
  family is mastered (judged correct at least `MASTER_RATE` of the time in the last phase that met it).
* The next task set holds retries of the tasks the judge found failed (at most half of `tasks_per_phase`:
  "target previous errors"), then new tasks at the frontier: fresh tasks of the easiest families above the
  hardest mastered difficulty ("increased difficulty"), and fresh tasks of the families still being learnt.
  Every new task comes from the desk's generator, so each has an executable validator.

The paper's generator is an LLM with its Fig. 9 prompt (`guijax.seagent.chat_curriculum`), which writes tasks
without validators that the judge alone rewards; phases cannot run such tasks yet.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from envs.api import Task
from guijax.seagent.world_state import Judgment

MASTER_RATE = 0.75  # a family is mastered when judged correct this often in the last phase that met it


@dataclasses.dataclass
class FamilyRecord:
    """What the guidebook knows about one desk family."""

    difficulty: int
    judged: int = 0
    correct: int = 0
    last_rate: float | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def mastered(self) -> bool:
        return self.last_rate is not None and self.last_rate >= MASTER_RATE


@dataclasses.dataclass
class Curriculum:
    """U_p and I_p: the guidebook (per family) and the tasks of the next phase."""

    phase: int
    tasks: list[Task]
    families: dict[str, FamilyRecord]

    def guidebook(self) -> str:
        """U_p as text: one line per family, easiest first."""
        lines = []
        for name, rec in sorted(self.families.items(), key=lambda kv: (kv[1].difficulty, kv[0])):
            state = "not tried" if rec.last_rate is None else ("mastered" if rec.mastered else "learning")
            seen = f"judged correct {rec.correct}/{rec.judged}" if rec.judged else "no episode yet"
            errors = f"; errors seen: {'; '.join(rec.errors[-3:])}" if rec.errors else ""
            lines.append(f"{name} (difficulty {rec.difficulty}): {state}, {seen}{errors}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "tasks": [t.to_dict() for t in self.tasks],
                "families": {k: dataclasses.asdict(v) for k, v in self.families.items()},
                "guidebook": self.guidebook()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Curriculum":
        tasks = [Task.from_dict(t, domain=t.get("domain", "")) for t in data["tasks"]]
        return cls(int(data["phase"]), tasks, {k: FamilyRecord(**v) for k, v in data["families"].items()})


class DeskCurriculum:
    """The offline M_task over the desk families named in `ladder` (the ones it may introduce)."""

    def __init__(self, ladder: Sequence[str], screen_hw: tuple[int, int], tasks_per_phase: int, seed: int = 0):
        from envs.desk.families import FAMILIES

        unknown = [f for f in ladder if f not in FAMILIES]
        if unknown:
            raise ValueError(f"seagent.curriculum_families names {unknown}; desk families: {sorted(FAMILIES)}")
        if tasks_per_phase < 1:
            raise ValueError(f"seagent.tasks_per_phase must be >= 1, got {tasks_per_phase}")
        self.difficulty = {f: FAMILIES[f][0] for f in ladder}
        self.screen_hw, self.tasks_per_phase, self.seed = tuple(screen_hw), tasks_per_phase, seed

    def initial(self, tasks: Sequence[Task]) -> Curriculum:
        """I_0: the given tasks (the run's training split); U_0 knows the ladder's families and nothing more."""
        return Curriculum(1, list(tasks), {f: FamilyRecord(d) for f, d in self.difficulty.items()})

    def update(self, cur: Curriculum, results: Sequence[tuple[Task, Judgment]]) -> Curriculum:
        """U_{p+1} and I_{p+1} from phase p's judged episodes (a task may appear once per episode)."""
        from envs.tasks import generate_desk_tasks

        families = {k: dataclasses.replace(v, errors=list(v.errors)) for k, v in cur.families.items()}
        phase_counts: dict[str, list[int]] = {}
        failed: dict[str, Task] = {}
        for task, judgment in results:
            rec = families.setdefault(task.domain, FamilyRecord(self.difficulty.get(task.domain, 0)))
            rec.judged += 1
            rec.correct += int(judgment.correct)
            counts = phase_counts.setdefault(task.domain, [0, 0])
            counts[0] += int(judgment.correct)
            counts[1] += 1
            if not judgment.correct:
                failed.setdefault(task.id, task)
                if judgment.error_type and judgment.error_type not in rec.errors:
                    rec.errors.append(judgment.error_type)
        for name, (correct, total) in phase_counts.items():
            families[name].last_rate = correct / total
        retries = list(failed.values())[:self.tasks_per_phase // 2]
        mastered = [f for f in self.difficulty if families[f].mastered]
        top = max((self.difficulty[f] for f in mastered), default=0)
        harder = sorted({self.difficulty[f] for f in self.difficulty if self.difficulty[f] > top})
        frontier = [f for f in self.difficulty if harder and self.difficulty[f] == harder[0]]
        learning = [f for f in self.difficulty if f in phase_counts and not families[f].mastered]
        pick = list(dict.fromkeys(frontier + learning)) or list(self.difficulty)
        new = generate_desk_tasks(self.tasks_per_phase - len(retries), seed=self.seed * 1000 + cur.phase,
                                  families=pick, screen_hw=self.screen_hw)
        # ids unique across phases: a phase's generator restarts its numbering
        new = [dataclasses.replace(t, id=f"{t.id}-p{cur.phase + 1}") for t in new]
        return Curriculum(cur.phase + 1, retries + new, families)
