"""SGCD, skill-guided continuation distillation (sgcd.txt §4, Algorithm 1), as methods trained from the base
policy without an RL loop. Each round, on the training tasks:

I.   the plain policy rolls every task out M times (Eq. 5-7): successes D⁺, and the tasks it fails;
II.  a skill per failed task from its successful and failed references (four fields, `guijax.sgcd.skills`);
     the skill-guided policy (the same parameters, the skill in its context, Eq. 3) tries each from a reset,
     and the tasks it solves are recoverable (Eq. 8);
III. for every recoverable task and handoff depth k: the plain policy acts k steps, the skill-guided policy
     continues from that exact state (Eq. 9-11; every depth branches from one prefix unless
     `sgcd.branching=live`); the verifier, then the judge, keep the spliced rollouts D_cont;
IV.  supervised training of the plain policy (no skill text anywhere) on D_exp ∪ D⁺ with every step supervised
     and D_cont with the post-handoff steps only (Eq. 12-13).

The next round starts from the policy the last one trained. Methods: `sgcd`, and two controls:
`sgcd_no_continuations` (Eq. 13 without L_cont: the same rounds training on D_exp ∪ D⁺ alone) and
`sgcd_full_supervision` (D_cont's pre-handoff steps supervised too, the alternative of the paper's Fig. 4).
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from typing import Any, ClassVar, Literal

from envs.atomic import write_text_atomic
from guijax.methods.base import Context, Method, Round, resumable_rounds
from guijax.rollout.trajectory import Status
from guijax.schema import ranged
from guijax.sgcd.skills import FIELDS


@dataclasses.dataclass(frozen=True)
class SGCDOptions:
    """`sgcd`: the rounds, the four stages' budgets, the skill extractor and the judge, and the Continuation
    Success Rate measured by the `csr` stage."""

    rounds: int = ranged(1, low=1)  # R of Algorithm 1: v0 -> vR
    rollouts_per_task: int = ranged(4, low=1)  # M (Eq. 5)
    failed_below: float = ranged(1.0, low=0, high=1)  # a task is failed when its plain success rate is below this
    skill_rollouts: int = ranged(1, low=1)  # skill-guided episodes from a reset that decide recoverability (Eq. 8)
    max_handoff: int = ranged(20, low=1)  # handoff depths k = 1..K (the paper's 1..20) ...
    handoff_depths: tuple[int, ...] = ranged((), low=1)  # ... or exactly these (Table 5's buckets)
    # how a continuation reaches the state after k plain steps: restore a snapshot of one prefix | reset and
    # replay the prefix's actions, checking each screen | run a fresh plain prefix per depth (the paper's way)
    branching: Literal["snapshot", "replay", "live"] = "snapshot"
    replay_tolerance: float = ranged(0.0, low=0)  # replay: mean absolute pixel difference a screen may differ by
    continuations_per_state: int = ranged(1, low=1)
    # a prefix answer that would end the episode (DONE / FAIL / CALL_USER / unparsable) is sampled again this many
    # times, so a policy that stops after its first wrong step still reaches depths k > 1 (0: the prefix ends
    # there); snapshot or replay branching only, as live branching keeps no prefix
    prefix_stop_retries: int = ranged(0, low=0)
    skill_extractor: Literal["desk", "chat"] = "desk"  # desk: offline, from the desk's ground truth
    skill_fields: tuple[str, ...] = FIELDS  # rendered into the skill-guided context (Table 3's ablation)
    skill_retries: int = ranged(2, low=0)  # chat: malformed answers asked again before the task is skipped
    judge: Literal["rule", "chat", "none"] = "rule"
    judge_max_repeats: int = ranged(2, low=1)  # rule judge: an action repeated more often in a row is a loop
    # chat judge: the screens of the last N post-handoff steps go with their responses (0: text only)
    judge_screenshots: int = ranged(0, low=0)
    chat_url: str = ""  # skill extractor / judge endpoint (OpenAI-compatible)
    chat_model: str = ""
    chat_api_key_env: str = "OPENAI_API_KEY"
    expert_data: bool = True  # D_exp in Eq. 13: the converted expert traces of the training tasks
    sft_steps: int = ranged(30, low=1)  # Stage IV steps per round
    batch_trajectories: int = ranged(8, low=1)  # step rows per batch
    learning_rate: float = ranged(1e-5, low=0)
    csr_max_handoff: int = ranged(20, low=1)  # csr stage: depths 1..K
    csr_splits: tuple[Literal["train", "held_out", "expert_only"], ...] = ("train", "held_out")
    csr_per_state: int = ranged(1, low=1)  # csr stage: evaluated-model episodes per (task, depth)
    # csr stage: as prefix_stop_retries, for its prefixes (whose failure-step histogram then counts the redrawn ones)
    csr_prefix_stop_retries: int = ranged(0, low=0)
    # csr stage: other models continuing the same prefixes (Table 6's baselines), each "NAME=DIR" (a Hugging Face
    # checkpoint of the run's family) or "NAME=DIR@PROMPT" when prompted otherwise than rollout.prompt (e.g.
    # pyautogui_think for a Thinking backbone); the prefix is shown to it rewritten in its grammar
    csr_baselines: tuple[str, ...] = ()


class SGCD(Method):
    name = "sgcd"
    summary = "SGCD: plain rollouts, skills, skill-guided continuations from k-step handoffs, mixed SFT"
    section = "sgcd"
    options_class = SGCDOptions
    requires = ("expert",)
    losses = ("sft",)  # Stage IV is supervised (and the dry run compiles that step)
    rl = False
    continuations: ClassVar[bool] = True
    k_start: ClassVar[bool] = True  # supervise D_cont from the handoff on (Eq. 12)

    @property
    def reads(self) -> tuple[str, ...]:
        """Its section but the `csr` stage's keys (a changed measurement does not retrain), rollouts and envs."""
        own = tuple(f"sgcd.{f.name}" for f in dataclasses.fields(SGCDOptions) if not f.name.startswith("csr_"))
        return own + ("rollout", "env")

    def depths(self) -> list[int]:
        o = self.options
        return sorted(set(o.handoff_depths)) if o.handoff_depths else list(range(1, o.max_handoff + 1))

    def validate(self) -> None:
        super().validate()
        o = self.options
        unknown = [f for f in o.skill_fields if f not in FIELDS]
        if unknown:
            raise ValueError(f"sgcd.skill_fields names {unknown}; the skill's fields are {list(FIELDS)}")
        if "chat" in (o.skill_extractor, o.judge) and not (o.chat_url and o.chat_model):
            raise ValueError("sgcd.skill_extractor or sgcd.judge is 'chat': set sgcd.chat_url and sgcd.chat_model "
                             "(an OpenAI-compatible endpoint; the key is read from $" + o.chat_api_key_env + ")")
        if o.skill_extractor == "desk" and self.config.env.kind != "desk":
            raise ValueError(f"sgcd.skill_extractor='desk' reads the synthetic desk's ground truth; with "
                             f"env.kind={self.config.env.kind!r} use sgcd.skill_extractor='chat'")
        if o.prefix_stop_retries and o.branching == "live":
            raise ValueError("sgcd.prefix_stop_retries samples a prefix's stop again, and sgcd.branching='live' runs "
                             "no prefix apart from its continuation; use 'snapshot' or 'replay' branching, or set "
                             "sgcd.prefix_stop_retries=0")
        if o.branching == "snapshot" and self.config.env.kind != "desk":
            raise ValueError(f"sgcd.branching='snapshot' needs environments that save and restore their state (the "
                             f"desk); with env.kind={self.config.env.kind!r} use 'replay' or 'live'")

    def describe(self) -> str:
        o, depths = self.options, self.depths()
        return (f"{self.summary}: {o.rounds} round(s); M={o.rollouts_per_task}, handoff k in {depths[0]}..{depths[-1]} "
                f"({o.branching}), {o.skill_extractor} skills, {o.judge} judge, {o.sft_steps} SFT steps per round")

    # ------------------------------------------------------------------ parts
    def _client(self):
        from guijax.chat import ChatClient

        o = self.options
        return ChatClient(o.chat_url, o.chat_model, o.chat_api_key_env)

    def grammar(self) -> str:
        """The action grammar the run's policy writes, which the offline extractor and rule judge read (with its
        UI-TARS coordinates, `rollout.coordinate_model`)."""
        from guijax.rollout.prompt import grammar_of

        return grammar_of(self.config.rollout.prompt)

    def extractor(self):
        o = self.options
        if o.skill_extractor == "chat":
            from guijax.sgcd.skills import ChatSkillExtractor

            return ChatSkillExtractor(self._client(), retries=o.skill_retries)
        from guijax.sgcd.desk_skills import DeskSkillExtractor

        return DeskSkillExtractor(tuple(self.config.env.screen), self.config.env.popups,
                                  self.config.rollout.coordinate_model, grammar=self.grammar())

    def judge(self):
        o = self.options
        if o.judge == "chat":
            from guijax.sgcd.judge import ChatJudge

            return ChatJudge(self._client(), retries=o.skill_retries, screenshots=o.judge_screenshots)
        if o.judge == "rule":
            from guijax.sgcd.judge import RuleJudge

            desk = self.config.env.kind == "desk"
            return RuleJudge(o.judge_max_repeats, tuple(self.config.env.screen) if desk else None, self.config.env.popups,
                             self.config.rollout.coordinate_model, grammar=self.grammar())
        return None

    # ------------------------------------------------------------------ the rounds
    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        resumable_rounds(ctx, policy, self.name, self.options.rounds, "round", f"{self.section}_metrics.jsonl",
                         lambda rnd: self.round(ctx, policy, pipeline, rnd))

    def round(self, ctx: Context, policy: Any, pipeline: Any, rnd: Round) -> str:
        from guijax.data.store import TrajectoryStore
        from guijax.sft import sft_steps

        o, streams, rd, r, writer = self.options, rnd.streams, rnd.folder, rnd.index, rnd.writer
        got = self.collect(rnd.engine, policy.params, list(ctx.train_tasks), streams, f"{self.name} r{r}")
        write_text_atomic(rd / "skills.json", json.dumps({"skills": {k: v.to_json() for k, v in got.skills.items()},
                                                          "skipped": got.skipped}, indent=1))
        # Stage IV: D_exp ∪ D⁺ fully supervised, D_cont from its handoff on; no skill text in any prompt.
        d_exp = []
        if o.expert_data:
            traces = ctx.expert_traces()
            d_exp = [traces[t.id] for t in ctx.train_tasks if t.id in traces]
        data = d_exp + got.d_plus + (got.d_cont if self.continuations else [])
        refs = supervised_steps(data, self.k_start)
        if got.d_plus or got.d_cont:
            TrajectoryStore(rd / "data").append(got.d_plus + got.d_cont, name="policy_data")
        history: list[float] = []
        if refs:
            policy.params, history = sft_steps(policy, data, policy.processor, self.config, pipeline, o.sft_steps,
                                               o.batch_trajectories, seed=streams.seed_for("sft"), log=writer.write,
                                               desc=f"{self.name} r{r} sft", learning_rate=o.learning_rate, refs=refs)
        report = got.report() | {"round": r, "d_exp": len(d_exp), "supervised_steps": len(refs),
                                 "sft_loss_first": history[0] if history else None,
                                 "sft_loss_last": history[-1] if history else None}
        write_text_atomic(rd / "round.json", json.dumps(report, indent=1))
        writer.write({k: v for k, v in report.items() if isinstance(v, (int, float))})
        return (f"plain {100 * report['plain_success_rate']:.0f}%, {report['failed_tasks']} failed tasks, "
                f"{report['skills']} skills, {report['recoverable_tasks']} recoverable, "
                f"{report['d_cont']}/{report['handoffs_tried']} handoffs kept, {len(refs)} supervised steps"
                + (f", loss {history[0]:.3f} -> {history[-1]:.3f}" if history else ""))

    def collect(self, engine: Any, params: Any, tasks: list, streams: Any, desc: str) -> "RoundData":
        """Stages I-III with the policy of `params` over `engine`: what Stage IV trains on."""
        from guijax.rollout.handoff import HandoffRunner
        from guijax.sgcd.skills import SkillSkipped

        o = self.options
        by_id = {t.id: t for t in tasks}
        got = RoundData(tasks=len(tasks))
        # Stage I: M plain rollouts per task.
        plain, _ = engine.run(params, tasks, o.rollouts_per_task, streams.key("plain"), seed=streams.seed_for("plain"),
                              desc=f"{desc} plain")
        groups: dict[str, list] = defaultdict(list)
        for t in plain:
            if t.status != Status.ENV_ERROR:
                groups[t.task_id].append(t)
        got.plain_episodes = len(plain)
        got.rates = {tid: sum(t.success for t in g) / len(g) for tid, g in groups.items()}
        got.d_plus = [t for t in plain if t.success]
        got.failed = [tid for tid, rate in got.rates.items() if rate < o.failed_below]
        if not self.continuations:  # the control trains on D_exp ∪ D⁺ alone
            return got
        # Stage II: a skill per failed task, then recoverability under it (Eq. 8).
        extractor = self.extractor()
        for tid in got.failed:
            g = groups[tid]
            try:
                skill = extractor.extract(by_id[tid], [t for t in g if t.success], [t for t in g if not t.success])
            except SkillSkipped as e:
                got.skipped[tid] = str(e)
                continue
            if skill.is_empty():
                got.skipped[tid] = "the extractor found no evidence for any field"
                continue
            got.skills[tid] = skill
        guidance = {tid: s.render(o.skill_fields) for tid, s in got.skills.items()}
        guided_eps = [engine.episode(by_id[tid], streams.seed_for("guided", tid, m), guidance=guidance[tid])
                      for tid in got.skills for m in range(o.skill_rollouts)]
        guided, _ = engine.run_episodes(params, guided_eps, streams.key("guided"), f"{desc} guided")
        got.recoverable = sorted({t.task_id for t in guided if t.success})
        # Stage III: k-step handoffs from the plain policy to the skill-guided one, filtered.
        depths, rec_tasks = self.depths(), [by_id[tid] for tid in got.recoverable]
        if o.branching == "live":
            eps = [engine.episode(task, streams.seed_for("live", task.id, k, m), guidance=guidance[task.id], handoff=k)
                   for task in rec_tasks for k in depths for m in range(o.continuations_per_state)]
            spliced, _ = engine.run_episodes(params, eps, streams.key("live"), f"{desc} handoffs")
            spliced = [t for t in spliced if len(t.steps) > t.meta["handoff"]]  # the prefix ended the episode
        else:
            runner = HandoffRunner(engine, o.branching, o.replay_tolerance)
            prefixes = runner.prefixes(params, rec_tasks, max(depths), streams.key("prefix"),
                                       seed=streams.seed_for("prefix"), desc=f"{desc} prefixes",
                                       stop_retries=o.prefix_stop_retries)
            got.prefix_steps = {p.task.id: p.open_steps for p in prefixes}
            got.prefix_resamples = sum(p.resampled for p in prefixes)
            spliced = runner.continue_from(params, prefixes, depths, streams.key("continue"), guidance,
                                           o.continuations_per_state, desc=f"{desc} handoffs")
        judge = self.judge()
        got.handoffs_tried = len(spliced)
        for t in spliced:
            k = t.meta["handoff"]
            tally = got.per_depth.setdefault(k, {"tried": 0, "verified": 0, "kept": 0})
            tally["tried"] += 1
            if not t.success:
                continue
            tally["verified"] += 1
            verdict = judge.judge(by_id[t.task_id], t, k) if judge is not None else None
            if verdict is not None and not verdict.accept:
                got.rejections[verdict.reason.split(":")[0]] += 1
                continue
            tally["kept"] += 1
            got.d_cont.append(t)
        return got


@dataclasses.dataclass
class RoundData:
    """What Stages I-III of one round found."""

    tasks: int = 0
    plain_episodes: int = 0
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # plain success rate per task
    d_plus: list = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    skills: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    recoverable: list[str] = dataclasses.field(default_factory=list)
    handoffs_tried: int = 0
    per_depth: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    rejections: Counter = dataclasses.field(default_factory=Counter)
    d_cont: list = dataclasses.field(default_factory=list)
    prefix_steps: dict[str, int] = dataclasses.field(default_factory=dict)  # steps each prefix stayed open
    prefix_resamples: int = 0  # prefix answers that would have ended it, sampled again

    def report(self) -> dict[str, Any]:
        return {"tasks": self.tasks, "plain_episodes": self.plain_episodes,
                "plain_success_rate": sum(self.rates.values()) / len(self.rates) if self.rates else 0.0,
                "d_plus": len(self.d_plus), "failed_tasks": len(self.failed), "skills": len(self.skills),
                "skills_skipped": len(self.skipped), "recoverable_tasks": len(self.recoverable),
                "handoffs_tried": self.handoffs_tried,
                "handoffs_verified": sum(v["verified"] for v in self.per_depth.values()), "d_cont": len(self.d_cont),
                "judge_rejections": dict(self.rejections), "prefix_steps": self.prefix_steps,
                "prefix_resamples": self.prefix_resamples,
                "per_depth": {int(k): v for k, v in sorted(self.per_depth.items())}}


def supervised_steps(data: list, k_start: bool = True) -> list:
    """Step references that carry loss: every step, except that a continuation (meta['handoff'] = k) is
    supervised from step k+1 on when `k_start` (Eq. 12: the plain prefix is context only)."""
    from guijax.data.pipeline import StepRef

    return [StepRef(i, j, 1.0) for i, t in enumerate(data)
            for j in range(t.meta.get("handoff", 0) if k_start else 0, len(t.steps))]


class SGCDNoContinuations(SGCD):
    name = "sgcd_no_continuations"
    summary = "SGCD control: the same rounds, trained on D_exp and D+ only (no continuation loss)"
    continuations = False


class SGCDFullSupervision(SGCD):
    name = "sgcd_full_supervision"
    summary = "SGCD ablation: continuations supervised on every step, the pre-handoff ones included"
    k_start = False

