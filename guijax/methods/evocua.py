"""EvoCUA's offline evolution step (evocua.txt §5.2-5.3) as methods, trained from the base policy on the
`budget` stage's rollouts (dynamic compute budgeting, Eq. 1) and running no RL loop:

- `evocua_rft`: rejection-sampling fine-tuning on the successes, step-level denoised (redundant steps out of
  the loss; solved infeasible tasks reduced to their reasoning and terminate=failure);
- `evocua_dpo`: step-level DPO (Eq. 2) on the pairs mined at critical forking points of the failures
  (Pair I: action correction at t*; Pair II: reflection at t*+1);
- `evocua`: one evolution round, RFT then step-level DPO from the RFT policy (its own reference);
- `evocua_cycle`: the evolution cycle (§5): rounds in which the current policy rolls the training tasks out up
  the budget ladder itself, then RFT on that round's successes and step-level DPO on its failures; each
  round's rollouts, report and policy are kept, and a table and plot give the success per round.

Knobs in the `evocua` section."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, ClassVar, Literal

from envs.atomic import write_text_atomic
from guijax.methods.base import Context, Method, Round, resumable_rounds, stage_rollouts
from guijax.metrics import MetricsWriter
from guijax.progress import echo
from guijax.rng import Streams
from guijax.schema import ranged


class NothingToTrain(ValueError):
    """A phase found no data to train on (no success for RFT, no forking point for step-DPO)."""


@dataclasses.dataclass(frozen=True)
class EvoCUAOptions:
    """`evocua`: the budget ladder (Eq. 1) of the budget stage, denoising, and the RFT and step-DPO runs."""

    budgets: tuple[int, ...] = ranged((2, 4, 8), low=1)  # K = {k_i}: rollouts per task, strictly increasing
    thresholds: tuple[float, ...] = ranged((1.0, 0.5, 0.25), low=0, high=1)  # Λ = {τ_i}, not increasing
    denoise: bool = True  # mask redundant steps; infeasible successes keep only reasoning + terminate=failure
    rft_steps: int = ranged(20, low=1)
    dpo_steps: int = ranged(20, low=1)
    batch_trajectories: int = ranged(8, low=1)  # RFT: step rows per batch; DPO: chosen + rejected steps per batch
    # the offline comparisons' rate (`offline.learning_rate`); DPO on a few pairs collapses the policy well above it
    rft_learning_rate: float = ranged(1e-5, low=0)
    dpo_learning_rate: float = ranged(1e-5, low=0)
    beta: float = ranged(0.1, low=0, low_open=True)  # Eq. 2's β
    window: int = ranged(2, low=0)  # reference alignment window w around t*
    reflection: bool = True  # Pair II (reflection and recovery at t*+1)
    # who judges redundant steps for denoising and writes Pair II's reflections: 'rule' (the screen's ground truth
    # and the offline template) | 'chat' (an OpenAI-compatible vision model, guijax.evocua.chat_roles)
    model_roles: Literal["rule", "chat"] = "rule"
    # who says two screens are the same state when step-DPO looks for the forking point and Pair II's no-op:
    # 'exact' (equal screenshots: the desk's ground truth) | 'chat' (the VLM aligner on chat_url, for real screens)
    state_alignment: Literal["exact", "chat"] = "exact"
    chat_url: str = ""
    chat_model: str = ""
    chat_api_key_env: str = "OPENAI_API_KEY"
    chat_retries: int = ranged(2, low=0)
    rounds: int = ranged(2, low=1)  # evocua_cycle: evolution rounds (rollouts up the ladder, RFT, step-DPO)
    synthesized: bool = False  # evocua_cycle: roll out the synthesis stage's verified tasks beside the training split


class _EvoCUA(Method):
    phases: ClassVar[tuple[str, ...]] = ()  # what before_rl runs, in order: "rft", "step_dpo"
    section = "evocua"
    options_class = EvoCUAOptions
    requires = ("budget",)
    rl = False

    def rollouts(self, ctx: Context) -> list:
        train_ids = {t.id for t in ctx.train_tasks}
        return [t for t in stage_rollouts(ctx.run_dir, "budget_rollouts", "budget", self.name)
                if not train_ids or t.task_id in train_ids]

    def rft(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, writer: MetricsWriter,
            streams: Streams | None = None, folder: pathlib.Path | None = None) -> dict[str, Any]:
        """RFT on the rollouts' successes, in place on `policy.params`; what it trained on, for the report."""
        from guijax.evocua.denoise import denoise
        from guijax.data.pipeline import step_refs
        from guijax.sft import sft_steps

        o, streams = self.options, streams or ctx.streams
        wins = [t for t in rollouts if t.success and t.steps]
        if not wins:
            raise NothingToTrain(f"{self.name}: the rollouts hold no success to fine-tune on")
        unreadable = 0
        if o.denoise:
            infeasible = {t.id for t in ctx.train_tasks if t.infeasible}
            judge = self.chat_roles()[0] if o.model_roles == "chat" else None
            data = denoise(wins, infeasible, judge) if judge else denoise(wins, infeasible)
            unreadable = judge.unreadable if judge else 0
            trajectories, refs = data.trajectories, data.refs
            writer.write({"rft_trajectories": len(trajectories), "rft_steps_masked": data.masked_steps,
                          "rft_steps_total": data.total_steps, "rft_denoise_unreadable": unreadable})
            echo(f"  {self.name}: {len(trajectories)} successes, {data.masked_steps}/{data.total_steps} steps "
                 "denoised out of the loss")
        else:
            trajectories, refs = wins, step_refs(wins)
        policy.params, history = sft_steps(policy, trajectories, policy.processor, self.config, pipeline, o.rft_steps,
                                           o.batch_trajectories, seed=streams.seed_for(self.name, "rft"),
                                           log=writer.write, desc=f"{self.name} rft", learning_rate=o.rft_learning_rate,
                                           refs=refs)
        echo(f"  {self.name} rft: loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")
        return {"rft_trajectories": len(trajectories), "rft_steps_trained": len(refs),
                "rft_denoise_unreadable": unreadable,
                "rft_loss_first": history[0], "rft_loss_last": history[-1]}

    def step_dpo(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, writer: MetricsWriter,
                 streams: Streams | None = None, folder: pathlib.Path | None = None) -> dict[str, Any]:
        """Step-level DPO on the pairs mined from the rollouts, in place on `policy.params` (the policy it
        starts from is its reference); the pair counts and losses, for the report."""
        from guijax.evocua.step_dpo import exact_match, mine_pairs
        from guijax.offline import train_preferences

        o, streams, folder = self.options, streams or ctx.streams, folder or ctx.workdir
        reflector = self.chat_roles()[1] if o.model_roles == "chat" else None
        aligner = self.state_aligner()
        pairs, counts = mine_pairs(rollouts, o.window, o.reflection, seed=streams.seed_for(self.name, "pairs"),
                                   reflect=reflector, match=aligner or exact_match)
        counts["reflection_fallbacks"] = reflector.fallbacks if reflector else 0
        counts["alignment_calls"] = aligner.calls if aligner else 0
        counts["alignment_unreadable"] = aligner.unreadable if aligner else 0
        write_text_atomic(folder / "step_dpo_pairs.json", json.dumps(counts, indent=1))
        writer.write({f"dpo_{k}": v for k, v in counts.items()})
        if not pairs:
            raise NothingToTrain(f"{self.name}: no critical forking point among the rollouts "
                                 f"({counts['failures']} failures, {counts['failures_with_reference']} with a "
                                 "successful reference of their task)")
        echo(f"  {self.name}: {counts['action_correction_pairs']} action-correction and {counts['reflection_pairs']} "
             f"reflection pairs from {counts['failures_with_reference']} failures with a reference")
        policy.params, history = train_preferences(
            policy, "dpo", [[p.chosen, p.rejected] for p in pairs], self.config, pipeline, o.dpo_steps,
            o.batch_trajectories, seed=streams.seed_for(self.name, "dpo"), beta=o.beta,
            learning_rate=o.dpo_learning_rate, log=writer.write, last_step_only=True)
        echo(f"  {self.name} step-dpo: loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")
        return {**{f"dpo_{k}": v for k, v in counts.items()}, "dpo_loss_first": history[0],
                "dpo_loss_last": history[-1]}

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        writer = MetricsWriter(ctx.workdir, "offline_metrics.jsonl", console=False)
        try:
            rollouts = self.rollouts(ctx)
            for phase in self.phases:
                getattr(self, phase)(ctx, policy, pipeline, rollouts, writer)
        finally:
            writer.close()

    def describe(self) -> str:
        o = self.options
        what = {"rft": f"{o.rft_steps} RFT steps", "step_dpo": f"{o.dpo_steps} step-DPO steps (window {o.window})"}
        return f"{self.summary}: " + " + ".join(what[p] for p in self.phases)

    def validate(self) -> None:
        super().validate()
        from guijax.evocua.budget import BudgetLadder

        BudgetLadder(tuple(self.options.budgets), tuple(self.options.thresholds))
        o = self.options
        for knob, value in (("model_roles", o.model_roles), ("state_alignment", o.state_alignment)):
            if value == "chat" and not (o.chat_url and o.chat_model):
                raise ValueError(f"evocua.{knob} is 'chat': set evocua.chat_url and evocua.chat_model (an "
                                 f"OpenAI-compatible vision endpoint; the key is read from ${o.chat_api_key_env})")

    def _client(self) -> Any:
        from guijax.chat import ChatClient

        o = self.options
        return ChatClient(o.chat_url, o.chat_model, api_key_env=o.chat_api_key_env)

    def chat_roles(self) -> tuple[Any, Any]:
        """(denoising judge, reflection writer) on `evocua.chat_url`."""
        from guijax.evocua.chat_roles import ChatDenoiser, ChatReflectionWriter

        client = self._client()
        return ChatDenoiser(client, self.options.chat_retries), ChatReflectionWriter(client, self.options.chat_retries)

    def state_aligner(self) -> Any:
        """The VLM aligner on `evocua.chat_url` when `evocua.state_alignment` is 'chat'; None for exact screens."""
        from guijax.evocua.chat_roles import ChatStateAligner

        if self.options.state_alignment != "chat":
            return None
        return ChatStateAligner(self._client(), self.options.chat_retries)


class EvoCUARFT(_EvoCUA):
    name = "evocua_rft"
    summary = "EvoCUA RFT: budgeted rejection sampling, step-denoised SFT on the successes"
    phases = ("rft",)


class EvoCUADPO(_EvoCUA):
    name = "evocua_dpo"
    summary = "EvoCUA step-level DPO at critical forking points"
    phases = ("step_dpo",)


class EvoCUA(_EvoCUA):
    name = "evocua"
    summary = "EvoCUA round: RFT, then step-level DPO from the RFT policy"
    phases = ("rft", "step_dpo")


class EvoCUACycle(_EvoCUA):
    name = "evocua_cycle"
    summary = "EvoCUA evolution cycle: rounds of budgeted rollouts by the current policy, RFT, step-level DPO"
    phases = ("rft", "step_dpo")
    requires = ()

    def __init__(self, config):
        super().__init__(config)
        if self.options.synthesized:  # this run also reads the synthesis stage's tasks
            self.requires = ("synthesis",)

    def tasks(self, ctx: Context) -> list:
        """The tasks each round rolls out: the training split, and the synthesized ones when asked for."""
        from envs.tasks import load_tasks

        tasks = list(ctx.train_tasks)
        if self.options.synthesized:
            path = ctx.run_dir / "synthesized_tasks.json"
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: evocua.synthesized=True rolls out the synthesis stage's "
                                        "tasks; add 'synthesis' to config.stages before the stage that trains "
                                        f"{self.name}")
            tasks += load_tasks(path)
        return tasks

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        from guijax.evocua import budget as lib
        from guijax.evocua.cycle import plot_rounds, rounds_table

        o = self.options
        ladder = lib.BudgetLadder(tuple(o.budgets), tuple(o.thresholds))
        resumable_rounds(ctx, policy, self.name, o.rounds, "round", "offline_metrics.jsonl",
                         lambda rnd: self.round(ctx, policy, pipeline, ladder, rnd), keep=o.rounds)
        reports = [json.loads((ctx.workdir / f"round_{r}" / "round.json").read_text()) for r in range(1, o.rounds + 1)]
        write_text_atomic(ctx.workdir / "rounds.json", json.dumps(reports, indent=1))
        write_text_atomic(ctx.workdir / "rounds.md", rounds_table(reports) + "\n")
        plot_rounds(reports, ctx.workdir / "rounds.png")

    def round(self, ctx: Context, policy: Any, pipeline: Any, ladder: Any, rnd: Round) -> str:
        """One round from the current policy: its episodes up the ladder on the training tasks (kept in
        `round_N/rollouts`), RFT on their successes, step-DPO on their failures; `round_N/round.json`."""
        from guijax.data.store import write_named_shard
        from guijax.evocua import budget as lib
        from guijax.evocua.cycle import first_level_success

        def episodes(tasks, per_task: int, level: int):
            out, _ = rnd.engine.run(policy.params, list(tasks), per_task, rnd.streams.key("budget", level),
                                    seed=rnd.streams.seed_for("episodes", level),
                                    desc=f"{self.name} r{rnd.index} k{ladder.budgets[level]}")
            return out

        tasks = self.tasks(ctx)
        if not tasks:
            raise ValueError(f"{self.name}: the run has no training tasks to roll out")
        rollouts, budgets = lib.budgeted_rollouts(episodes, tasks, ladder)
        write_named_shard(rnd.folder / "rollouts", "rollouts", rollouts)
        report: dict[str, Any] = {"round": rnd.index, **lib.summary(budgets, ladder)}
        report["start_success"], report["tasks"] = first_level_success(rollouts, ladder.budgets[0])
        report["synthesized_tasks"] = len(tasks) - len(ctx.train_tasks)
        train_ids = {t.id for t in ctx.train_tasks}
        report["start_success_train"], _ = first_level_success([t for t in rollouts if t.task_id in train_ids],
                                                               ladder.budgets[0])
        if report["synthesized_tasks"]:
            report["start_success_synthesized"], _ = first_level_success(
                [t for t in rollouts if t.task_id not in train_ids], ladder.budgets[0])
        for phase in self.phases:
            try:
                report.update(getattr(self, phase)(ctx, policy, pipeline, rollouts, rnd.writer, rnd.streams,
                                                   rnd.folder))
            except NothingToTrain as e:  # a round without successes (or forking points) trains the other phase
                report[f"{phase}_skipped"] = str(e)
                echo(f"  {self.name} round {rnd.index}: {phase} skipped: {e}")
        write_text_atomic(rnd.folder / "round.json", json.dumps(report, indent=1))
        rnd.writer.write({k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        return (f"start success {100 * report['start_success']:.1f}% over {report['tasks']} tasks, "
                f"{report['episodes']} episodes, {report.get('rft_trajectories', 0)} RFT trajectories, "
                f"{report.get('dpo_action_correction_pairs', 0)} + {report.get('dpo_reflection_pairs', 0)} DPO pairs")

    def describe(self) -> str:
        o = self.options
        return (f"{self.summary}: {o.rounds} round(s) up the ladder {tuple(o.budgets)}, {o.rft_steps} RFT and "
                f"{o.dpo_steps} step-DPO steps each")
