"""SEAgent's specialist-to-generalist strategy (seagent.txt §3.3, Table 2) as a method.

1. Specialists: from the starting policy, one SEAgent run (its phases, judge and curriculum) per application,
   on that application's training tasks only (`seagent.apps`: on the desk an application is a set of task
   families, e.g. "click_button" or "toggle_checkbox+choose_option").
2. Each specialist rolls out its application's training tasks `seagent.distill_episodes` times; the episodes
   the judge calls correct are its successful trajectories (the paper generates 3.5K from the specialists'
   training instructions).
3. The generalist: the starting policy fine-tuned on every specialist's successes (`seagent.distill_steps` at
   `seagent.distill_learning_rate`), reasoning included, as the paper distils into a fresh base model.
4. Then SEAgent's phases on all applications' tasks from the generalist.

Every specialist is checkpointed phase by phase in `specialist_<app>/`, with its successes and a report; a rerun
resumes where it stopped. `specialists.json` gives each specialist's success rate on its own application's
training tasks in the collection rollouts (at `rollout.temperature`), beside the data the generalist got.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from envs.atomic import write_text_atomic
from guijax.methods.base import Context, resumable_rounds
from guijax.methods.seagent import SEAgent
from guijax.progress import echo


def app_name(app: str) -> str:
    return app.replace("+", "_")


class SpecialistToGeneralist(SEAgent):
    name = "seagent_s2g"
    summary = ("SEAgent specialist-to-generalist: a specialist per application, the starting policy fine-tuned on "
               "their judged successes, then SEAgent on every application")
    _families: tuple[str, ...] | None = None  # while a specialist trains: its application's families

    def apps(self) -> list[tuple[str, ...]]:
        return [tuple(a.split("+")) for a in self.options.apps]

    def validate(self) -> None:
        super().validate()
        o = self.options
        if len(o.apps) < 2:
            raise ValueError(f"seagent_s2g needs two or more applications in seagent.apps, got {list(o.apps)} "
                             "(e.g. ('click_button', 'toggle_checkbox+choose_option'))")
        if o.curriculum == "chat":
            raise ValueError("seagent_s2g splits the tasks by application; the chat curriculum writes its own: use "
                             "seagent.curriculum='none' or 'desk'")
        seen: dict[str, str] = {}
        for app in o.apps:
            for family in app.split("+"):
                if not family:
                    raise ValueError(f"seagent.apps: {app!r} has an empty family name")
                if family in seen:
                    raise ValueError(f"seagent.apps: family {family!r} is in both {seen[family]!r} and {app!r}")
                seen[family] = app
        known = set(self.config.env.families or ())
        unknown = sorted(set(seen) - known) if known else []
        if unknown:
            raise ValueError(f"seagent.apps names families {unknown} that are not in env.families {sorted(known)}")

    @staticmethod
    def folder(ctx: Context, app: tuple[str, ...]) -> Any:
        """Where an application's specialist keeps its phases, successes and report."""
        return ctx.workdir / f"specialist_{app_name('+'.join(app))}"

    def ladder(self) -> tuple[str, ...]:
        """A specialist's desk curriculum stays inside its application; the generalist's spans them all."""
        if self._families is None:
            return super().ladder()
        return tuple(f for f in super().ladder() if f in self._families) or self._families

    def specialist(self, ctx: Context, policy: Any, pipeline: Any, app: tuple[str, ...], start: Any) -> dict:
        """One application's specialist from `start`: its phases, then its judged successes (kept in its folder)."""
        import jax

        from guijax.data.store import TrajectoryStore
        from guijax.rollout.trajectory import Status

        o, name, folder = self.options, app_name("+".join(app)), self.folder(ctx, app)
        report_path = folder / "specialist.json"
        if report_path.exists():
            echo(f"  {self.name}: specialist {name} already trained ({report_path})")
            return json.loads(report_path.read_text())
        tasks = [t for t in ctx.train_tasks if t.domain in app]
        if not tasks:
            raise ValueError(f"seagent_s2g: no training task of application {'+'.join(app)} (families "
                             f"{sorted({t.domain for t in ctx.train_tasks})})")
        sub = dataclasses.replace(ctx, workdir=folder, train_tasks=tasks, streams=ctx.streams.child("specialist", name))
        policy.params = self.frozen_copy(policy, start)
        self._families = app  # the desk curriculum of this specialist stays inside its application
        try:
            resumable_rounds(sub, policy, f"{self.name} {name}", o.phases, "phase", f"{self.section}_metrics.jsonl",
                             lambda rnd: self.phase(sub, policy, pipeline, rnd))
        finally:
            self._families = None
        engine = ctx.rollout_engine(policy, self.config.rollout.temperature)
        streams = sub.streams.child("distill")
        rollouts, _ = engine.run(policy.params, tasks, o.distill_episodes, jax.random.PRNGKey(streams.seed_for("rollouts")),
                                 seed=streams.seed_for("episodes"), desc=f"{self.name} {name} collection")
        rollouts = [t for t in rollouts if t.status != Status.ENV_ERROR and t.steps]
        judge, by_id = self.judge(), {t.id: t for t in tasks}
        wins = [t for t in rollouts if judge.judge(by_id[t.task_id], t).correct]
        if wins:
            TrajectoryStore(folder / "successes").append(wins, name="successes")
        report = {"app": "+".join(app), "tasks": len(tasks), "episodes": len(rollouts), "judged_successes": len(wins),
                  "verified_successes": sum(t.success for t in rollouts),
                  "success_rate": sum(t.success for t in rollouts) / max(len(rollouts), 1),
                  "per_family": {f: _rate([t for t in rollouts if by_id[t.task_id].domain == f]) for f in app}}
        write_text_atomic(report_path, json.dumps(report, indent=1))
        echo(f"  {self.name}: specialist {name}: {len(wins)}/{len(rollouts)} collection episodes judged correct")
        return report

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        from guijax.data.store import TrajectoryStore
        from guijax.sft import sft_steps

        o = self.options
        start = self.frozen_copy(policy, policy.params)  # training steps donate the parameters they are given
        reports = [self.specialist(ctx, policy, pipeline, app, start) for app in self.apps()]
        generalist_dir = ctx.workdir / "generalist"
        done = generalist_dir / "distilled.json"
        if not done.exists():
            stores = [self.folder(ctx, app) / "successes" for app in self.apps()]
            data = [t for store in stores if store.exists() for t in TrajectoryStore(store)]
            policy.params = self.frozen_copy(policy, start)
            history: list[float] = []
            if data:
                policy.params, history = sft_steps(policy, data, policy.processor, self.config, pipeline, o.distill_steps,
                                                   o.batch_rows, seed=ctx.streams.seed_for("distill"),
                                                   desc=f"{self.name} distill", learning_rate=o.distill_learning_rate)
            else:
                echo(f"  {self.name}: no specialist success to distil; the generalist starts from the starting policy")
            generalist_dir.mkdir(parents=True, exist_ok=True)
            _save_params(generalist_dir / "params", policy.params)
            summary = {"specialists": reports, "distilled_trajectories": len(data), "distill_steps": len(history),
                       "distill_loss_first": history[0] if history else None,
                       "distill_loss_last": history[-1] if history else None}
            write_text_atomic(ctx.workdir / "specialists.json", json.dumps(summary, indent=1))
            write_text_atomic(done, json.dumps({"trajectories": len(data)}))
            echo(f"  {self.name}: generalist distilled from {len(data)} specialist successes")
        else:
            policy.params = _load_params(generalist_dir / "params", policy.params)
        sub = dataclasses.replace(ctx, workdir=generalist_dir, streams=ctx.streams.child("generalist"))
        resumable_rounds(sub, policy, f"{self.name} generalist", o.phases, "phase", f"{self.section}_metrics.jsonl",
                         lambda rnd: self.phase(sub, policy, pipeline, rnd))

    @staticmethod
    def frozen_copy(policy: Any, params: Any) -> Any:
        from guijax import train_step
        from guijax.models.trained import TrainedPart

        return train_step.reference_params(params, TrainedPart.of(policy.module))

    def describe(self) -> str:
        o = self.options
        return (f"{self.summary}; applications {list(o.apps)}, {o.phases} phase(s) each and for the generalist, "
                f"{o.distill_episodes} collection episodes per task, {o.distill_steps} distillation steps")


def _rate(rollouts: list) -> float | None:
    return sum(t.success for t in rollouts) / len(rollouts) if rollouts else None


def _save_params(path, params) -> None:
    from guijax.checkpoint import Checkpointer

    ckpt = Checkpointer(path, keep=1, async_save=False)
    try:
        ckpt.save(0, params, {"generalist": True})
        ckpt.manager.wait_until_finished()
    finally:
        ckpt.close()


def _load_params(path, like):
    from guijax.checkpoint import Checkpointer

    ckpt = Checkpointer(path, keep=1, async_save=False)
    try:
        restored = ckpt.restore_latest(like, lambda params, meta: params)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"seagent_s2g: the distilled generalist's parameters are missing from {path}")
    return restored[1]
