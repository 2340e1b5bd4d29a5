"""SEAgent's experiential learning (seagent.txt §3.2, Alg. 1) as a method: phases of rollouts judged by the
World State Model, then step-level RL on the judged states, with no RL loop of its own.

Each phase p: the current policy rolls out the training tasks; the judge (`seagent.judge`: the desk's
ground-truth oracle, or an OpenAI-compatible vision model with Fig. 8's prompt) judges every episode and A.3
labels its steps; G responses are sampled at every a_T state and scored by Eq. 4 against it, giving Eq. 3's
group advantages; one update (`guijax.seagent.step_rl`) trains L_GRPO (clipped, per-sequence mean, KL to
the phase's starting policy with `train.kl_coef`) + γ·L_AI on the a_F steps. Each phase writes
`phase_N/phase.json` and checkpoints the policy, so a rerun resumes after the last finished phase.

On the desk each judged episode's state-change captions (the World State Model's second output,
`guijax.seagent.captions`) go into `phase.json` beside its judgment.

A phase's tasks (`seagent.curriculum`): the training split; on the desk, the offline curriculum's tasks; or an
LLM's (Fig. 9, `guijax.seagent.chat_curriculum`): instructions without validators, run from the training
tasks' screens and judged by the chat judge, phase 1's from the captions of those screens. Off the desk the
chat judge's endpoint writes those captions and each phase's change descriptions
(`guijax.seagent.chat_captions`).

With `seagent.judge=trained` the judge is a World State Model trained in guijax before phase 1
(guijax.seagent.judge_training: LoRA on the base policy's model, ground-truth judgments and change descriptions
of the base policy's episodes on fresh desk tasks, scored against the verifier beside the untrained model).

Specialist-to-generalist training is `seagent_s2g` (guijax.methods.seagent_s2g).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from envs.atomic import write_text_atomic
from envs.tasks import task_entry, task_from_entry
from guijax.methods.base import Context, Method, Round, resumable_rounds
from guijax.schema import ranged


def _setup_key(setup: Any) -> str:
    """A task's setup steps as one comparable string: tasks with equal setups start from the same screen."""
    return json.dumps(list(setup), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SEAgentOptions:
    """`seagent`: phases, the judge, state-level sampling and the update."""

    phases: int = ranged(1, low=1)  # P: judge-then-update rounds
    episodes_per_task: int = ranged(4, low=1)  # rollouts of each training task per phase
    group_size: int = ranged(8, low=2)  # G responses sampled at each a_T state (Eq. 3)
    max_states: int = ranged(0, low=0)  # a_T states sampled per phase (0: all), the first in rollout order
    # oracle: the desk's ground truth; chat: an OpenAI-compatible vision model; trained: a World State Model
    # tuned in guijax (LoRA, or every parameter) before phase 1 (desk only: its training labels are the ground truth's)
    judge: Literal["oracle", "chat", "trained"] = "oracle"
    judge_retries: int = ranged(2, low=0)  # chat, trained: unreadable answers asked again
    # A.2: LoRA rank 128; 0: every parameter trains (a small model whose tied embeddings never wrote judgments)
    judge_lora_rank: int = ranged(128, low=0)
    judge_lora_alpha: float = ranged(256.0, low=0, low_open=True)  # LLaMA-Factory's default, 2 x rank
    judge_steps: int = ranged(2000, low=1)  # A.2: 2,000 iterations
    judge_learning_rate: float = ranged(2e-5, low=0, low_open=True)  # A.2
    judge_batch_size: int = ranged(8, low=1)
    judge_change_descriptions: bool = True  # co-train on change descriptions (Table 1's "w/ CD")
    judge_tasks: int = ranged(48, low=1)  # fresh desk tasks whose episodes train the judge
    judge_eval_tasks: int = ranged(24, low=1)  # another fresh set whose episodes score it
    judge_episodes_per_task: int = ranged(4, low=1)  # base-policy episodes per task, both sets
    judge_max_new_tokens: int = ranged(768, low=1)  # a judgment's reasoning and res_dict
    judge_length_buckets: tuple[int, ...] = (256, 512, 1024, 1536, 2048)  # judgment prompts are ~1k tokens
    chat_url: str = ""
    chat_model: str = ""
    chat_api_key_env: str = "OPENAI_API_KEY"
    gamma: float = ranged(0.2, low=0)  # γ of L = L_GRPO + γ·L_AI (Table 8)
    failure_loss: Literal["log_ratio", "bounded"] = "log_ratio"  # objectives.WithAdversarialImitation
    update_epochs: int = ranged(1, low=1)  # passes over a phase's rows
    batch_rows: int = ranged(8, low=1)
    learning_rate: float = ranged(1e-5, low=0)
    sampler_rows: int = ranged(64, low=1)  # prompts per sampler call in state-level sampling
    # the tasks of each phase: the training split every time | the desk's offline curriculum generator
    # (guijax.seagent.curriculum: retries of judged failures, then new tasks at the difficulty frontier) | an
    # OpenAI-compatible LLM with Fig. 9's prompt (guijax.seagent.chat_curriculum: instructions without
    # validators, run from the training tasks' screens and judged by the chat judge; phase 1's tasks too)
    curriculum: Literal["none", "desk", "chat"] = "none"
    tasks_per_phase: int = ranged(12, low=1)  # desk curriculum: tasks of phases 2..P; chat: of every phase
    curriculum_families: tuple[str, ...] = ()  # desk curriculum: families it may introduce (default env.families)
    curriculum_url: str = ""  # chat curriculum: the generator's endpoint (the paper: Qwen2.5-72B)
    curriculum_model: str = ""
    curriculum_api_key_env: str = "OPENAI_API_KEY"
    curriculum_descriptions: int = ranged(100, low=1)  # chat: state-change captions per prompt (App. G: 50-100)
    # specialist-to-generalist (seagent_s2g, §3.3): the applications, each a '+'-joined set of task families
    apps: tuple[str, ...] = ()
    distill_episodes: int = ranged(4, low=1)  # each specialist's rollouts per training task of its application
    distill_steps: int = ranged(40, low=1)  # fine-tuning steps of the generalist on the specialists' successes
    distill_learning_rate: float = ranged(1e-4, low=0, low_open=True)


class SEAgent(Method):
    name = "seagent"
    summary = "SEAgent: judged rollouts, step-level GRPO on a_T states + adversarial imitation of a_F steps"
    section = "seagent"
    options_class = SEAgentOptions
    losses = ("grpo",)
    normalizations = ("sequence", "token")
    rl = False

    @property
    def reads(self) -> tuple[str, ...]:
        return ("seagent", "rollout", "env")

    def validate(self) -> None:
        super().validate()
        o = self.options
        if o.judge == "chat" and not (o.chat_url and o.chat_model):
            raise ValueError("seagent.judge is 'chat': set seagent.chat_url and seagent.chat_model (an "
                             f"OpenAI-compatible vision endpoint; the key is read from ${o.chat_api_key_env})")
        if o.curriculum == "desk" and self.config.env.kind != "desk":
            raise ValueError(f"seagent.curriculum='desk' generates synthetic desk tasks; env.kind is "
                             f"{self.config.env.kind!r}: use seagent.curriculum='none'")
        if o.curriculum == "desk":
            self.curriculum(0)  # names an unknown family now rather than after the first phase
        if o.curriculum == "chat":
            if not (o.curriculum_url and o.curriculum_model):
                raise ValueError("seagent.curriculum is 'chat': set seagent.curriculum_url and seagent.curriculum_model "
                                 f"(an OpenAI-compatible endpoint; the key is read from ${o.curriculum_api_key_env})")
            if o.judge != "chat":
                raise ValueError("seagent.curriculum='chat' writes tasks without validators, which the oracle judge "
                                 "cannot judge: set seagent.judge='chat'")
        if o.judge in ("oracle", "trained") and self.config.env.kind != "desk":
            raise ValueError(f"seagent.judge={o.judge!r} reads the synthetic desk's ground truth (the trained judge "
                             f"learns from it); env.kind is {self.config.env.kind!r}: use seagent.judge='chat'")

    def loss(self) -> Any:
        from guijax import objectives

        o = self.options
        inner = objectives.make_loss(self.config.train.loss or "grpo", self.config.train)
        return objectives.WithAdversarialImitation(inner, o.gamma, o.failure_loss)

    def judge(self) -> Any:
        from guijax.seagent.world_state import ChatWorldStateJudge

        o = self.options
        if o.judge == "oracle":
            from guijax.seagent.world_state import desk_oracle

            return desk_oracle(self.config)
        if o.judge == "trained":
            if self._trained_judge is None:
                raise RuntimeError("seagent.judge='trained': the World State Model is trained in before_rl")
            return self._trained_judge
        from guijax.chat import ChatClient

        return ChatWorldStateJudge(ChatClient(o.chat_url, o.chat_model, api_key_env=o.chat_api_key_env),
                                   retries=o.judge_retries)

    def ladder(self) -> tuple[str, ...]:
        """The families the desk curriculum may set tasks of, in order of difficulty."""
        from envs.desk.families import FAMILIES

        return tuple(self.options.curriculum_families or self.config.env.families or FAMILIES)

    def curriculum(self, seed: int) -> Any:
        from guijax.seagent.curriculum import DeskCurriculum

        return DeskCurriculum(self.ladder(), tuple(self.config.env.screen), self.options.tasks_per_phase, seed)

    def phase_tasks(self, ctx: Context, p: int, engine: Any) -> tuple[list, Any]:
        """Phase p's tasks and, with the desk curriculum, its state (I_p, U_p): the initial one from the training
        split, later ones as phase p-1 left them in its folder."""
        from guijax.seagent.curriculum import Curriculum

        if self.options.curriculum == "none":
            return list(ctx.train_tasks), None
        if self.options.curriculum == "chat":
            return self.chat_phase_tasks(ctx, p, engine), None
        if p == 1:
            cur = self.curriculum(ctx.streams.seed_for("curriculum")).initial(ctx.train_tasks)
        else:
            cur = Curriculum.from_json(json.loads((ctx.workdir / f"phase_{p - 1}" / "curriculum.json").read_text()))
        return list(cur.tasks), cur

    def generator(self) -> Any:
        from guijax.chat import ChatClient
        from guijax.seagent.chat_curriculum import ChatCurriculumGenerator

        o = self.options
        return ChatCurriculumGenerator(ChatClient(o.curriculum_url, o.curriculum_model,
                                                  api_key_env=o.curriculum_api_key_env), retries=o.judge_retries)

    def captioner(self) -> Any:
        """The World State Model's captioning modes off the desk: the chat judge's endpoint."""
        from guijax.chat import ChatClient
        from guijax.seagent.chat_captions import ChatStateCaptioner

        o = self.options
        return ChatStateCaptioner(ChatClient(o.chat_url, o.chat_model, api_key_env=o.chat_api_key_env),
                                  retries=o.judge_retries)

    def scenes(self, ctx: Context, engine: Any) -> list[tuple[Any, list[str], list[str]]]:
        """The "software": each distinct initial screen of the training tasks (one per setup), as (task, the names
        of its elements, its captions C_0). On the desk they come from the accessibility tree. Elsewhere the
        tasks are set up on the run's environments (a round per pool size) and the chat World State Model
        captions each screenshot; the answers are kept in scenes.json with the setup and model they describe,
        which later phases and a resumed run reuse. A screen whose setup keeps failing or whose captions the
        model cannot write is left out of this phase with a warning (tried again next time)."""
        distinct, seen = [], set()
        for task in ctx.train_tasks:
            if _setup_key(task.config) not in seen:
                seen.add(_setup_key(task.config))
                distinct.append(task)
        if self.config.env.kind == "desk":
            from envs.desk.a11y import parse_tree
            from envs.desk.env import DeskEnv
            from guijax.seagent.captions import screen_captions

            trees = [DeskEnv(tuple(self.config.env.screen), popups=False).reset(t).a11y_tree or "" for t in distinct]
            return [(t, [n.name for n in parse_tree(tree)], screen_captions(tree)) for t, tree in zip(distinct, trees)]
        return self._captioned_scenes(ctx, engine, distinct)

    def _captioned_scenes(self, ctx: Context, engine: Any, distinct: list) -> list[tuple[Any, list[str], list[str]]]:
        import logging

        from guijax.chat import UnreadableAnswer

        path, model = ctx.workdir / "scenes.json", self.options.chat_model
        kept = json.loads(path.read_text()) if path.exists() else {}

        def current(task) -> bool:
            entry = kept.get(task.id)
            return (entry is not None and entry["model"] == model
                    and _setup_key(entry["setup"]) == _setup_key(task.config))

        todo, captioner, workers = [t for t in distinct if not current(t)], None, engine.pool.num_workers
        for first in range(0, len(todo), workers):
            batch = todo[first:first + workers]
            results = engine.reset(batch, range(len(batch)))  # retried as the rollouts' resets are
            for slot, task in enumerate(batch):
                if not results[slot].ok:
                    logging.warning("seagent: task %s's setup failed, its screen is not captioned this phase: %s",
                                    task.id, results[slot].error)
                    continue
                captioner = captioner or self.captioner()
                try:
                    shown = captioner.screen(results[slot].value.screenshot, f"task {task.id}'s initial screen")
                except UnreadableAnswer as e:  # a down endpoint (ChatError) stops the run, as it stops the judge
                    logging.warning("seagent: task %s's screen is not captioned this phase: %s", task.id, e)
                    continue
                kept[task.id] = {"setup": list(task.config), "model": model, "elements": list(shown.elements),
                                 "captions": list(shown.captions)}
                write_text_atomic(path, json.dumps(kept, indent=1))
        scenes = [(t, kept[t.id]["elements"], kept[t.id]["captions"]) for t in distinct if current(t)]
        if not scenes:
            raise RuntimeError(f"seagent: none of the {len(distinct)} training screens could be set up and "
                               "captioned for the curriculum (the warnings above say why)")
        return scenes

    @staticmethod
    def buffer_path(ctx: Context, p: int) -> Any:
        """Where phase p's tasks and the guidebook they came with are written: by phase p-1, or before phase 1."""
        return ctx.workdir / (f"phase_{p - 1}" if p > 1 else "") / "curriculum.json"

    def chat_buffer(self, ctx: Context, p: int, buffer: Any, scenes: list[tuple[Any, list[str], list[str]]]) -> list:
        """Phase p's tasks from a task buffer, placed on the training screens and written to `buffer_path` (the
        phase reads them from there when a run resumes)."""
        from guijax.seagent.chat_curriculum import place_on_scenes

        placed, left_out = place_on_scenes(buffer.instructions(), [task for task, _, _ in scenes],
                                           [names for _, names, _ in scenes], f"seagent-p{p}")
        placed = placed[:self.options.tasks_per_phase]
        path = self.buffer_path(ctx, p)
        if not placed:
            raise RuntimeError(f"seagent: none of the generator's {len(buffer.tasks)} tasks for phase {p} names an "
                               f"element of the training screens ({path}); left out: {left_out[:5]}")
        write_text_atomic(path, json.dumps({"phase": p, "tasks": [task_entry(t) for t in placed],
                                            "left_out": left_out, **buffer.to_json()}, indent=1))
        return placed

    def chat_phase_tasks(self, ctx: Context, p: int, engine: Any) -> list:
        """I_p: phase p-1's answer from the generator (written by that phase), or for phase 1 the generator's
        answer to the captions of the training screens (Alg. 1 lines 3-4), asked each time phase 1 starts (a
        kept answer could come from another configuration) and written where phase 1 reads its guidebook."""
        if p == 1:
            scenes = self.scenes(ctx, engine)
            c0 = [c for _, _, captions in scenes for c in captions]
            return self.chat_buffer(ctx, 1, self.generator().update(c0), scenes)
        path = self.buffer_path(ctx, p)  # a placed task keeps its scene's file: its setup's relative URLs
        return [task_from_entry(t, f"{path} task {i}") for i, t in enumerate(json.loads(path.read_text())["tasks"])]

    _trained_judge: Any = None

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        if self.options.judge == "trained":
            from guijax.seagent.judge_training import world_state_model

            self._trained_judge = world_state_model(ctx, policy, pipeline)
        resumable_rounds(ctx, policy, self.name, self.options.phases, "phase", f"{self.section}_metrics.jsonl",
                         lambda rnd: self.phase(ctx, policy, pipeline, rnd))

    def phase(self, ctx: Context, policy: Any, pipeline: Any, rnd: Round) -> str:
        import jax
        import numpy as np

        from guijax import train_step
        from guijax.models.trained import TrainedPart
        from guijax.rollout.trajectory import Status
        from guijax.seagent import step_rl
        from guijax.seagent.chat_curriculum import is_judged
        from guijax.seagent.world_state import Label, score_judge, step_labels

        o, p = self.options, rnd.index
        streams, folder, writer, engine = rnd.streams, rnd.folder, rnd.writer, rnd.engine
        phase_tasks, cur = self.phase_tasks(ctx, p, engine)
        tasks = {t.id: t for t in phase_tasks}
        rollouts, _ = engine.run(policy.params, list(tasks.values()), o.episodes_per_task,
                                 jax.random.PRNGKey(streams.seed_for("rollouts")), seed=streams.seed_for("episodes"),
                                 desc=f"{self.name} p{p} rollouts")
        rollouts = [t for t in rollouts if t.status != Status.ENV_ERROR and t.steps]
        judge = self.judge()
        records = self.records(tasks, rollouts)
        if hasattr(judge, "judge_all"):  # the trained judge: batched, and shown the final screen it learnt from
            judgments = judge.judge_all([(tasks[t.task_id], t, r.final_screenshot if r else None)
                                         for t, r in zip(rollouts, records)])
        else:
            judgments = [judge.judge(tasks[t.task_id], t) for t in rollouts]
        labels = [step_labels(j, len(t.steps)) for j, t in zip(judgments, rollouts)]
        positives, failures = step_rl.labelled_states(labels)
        positives, unparsable = step_rl.parsable_states(rollouts, positives, engine.config.coordinate_model,
                                                        engine.config.grammar)
        if o.max_states:
            positives = positives[:o.max_states]
        samples = step_rl.sample_at_states(engine, policy.params, rollouts, positives, o.group_size,
                                           jax.random.PRNGKey(streams.seed_for("samples")), o.sampler_rows)
        rewards = step_rl.sample_rewards(rollouts, positives, samples, engine.config.coordinate_model,
                                         engine.config.grammar)
        data = step_rl.training_rows(rollouts, positives, samples, step_rl.group_advantages(rewards), failures)
        history: list[dict[str, float]] = []
        if data.refs:
            reference = train_step.reference_params(policy.params, TrainedPart.of(policy.module))
            policy.params, history = step_rl.update(
                policy, reference, data, self.loss(), self.config, pipeline, o.batch_rows, o.update_epochs,
                o.learning_rate, streams.seed_for("batches"), log=writer.write)
        captions = [r.captions if r is not None else None for r in records]
        described = None
        if o.curriculum == "chat" and self.config.env.kind != "desk":  # the generator's feedback from the chat WSM
            from guijax.seagent.chat_captions import episode_captions

            described = episode_captions(self.captioner(), rollouts, o.curriculum_descriptions)
            captions = described.captions
        verifiable = [not is_judged(tasks[t.task_id]) for t in rollouts]  # the curriculum's tasks have no validator
        score = score_judge([j for j, v in zip(judgments, verifiable) if v],
                            [t.success for t, v in zip(rollouts, verifiable) if v])
        report = {
            "phase": p, "episodes": len(rollouts), "verified_episodes": sum(verifiable),
            "verified_successes": sum(t.success for t, v in zip(rollouts, verifiable) if v),
            "judged_correct": score.judged_correct, "judge_precision": score.precision, "judge_npv": score.npv,
            "judge_unreadable": sum(not j.readable for j in judgments),
            "a_T": sum(row.count(Label.CORRECT) for row in labels),
            "a_F": sum(row.count(Label.FAILURE) for row in labels), "a_T_unparsable": len(unparsable),
            "states_sampled": len(positives),
            "mean_step_reward": float(np.mean(rewards)) if rewards.size else 0.0,
            "groups_kept": data.groups_kept, "groups_flat": data.groups_flat, "failure_rows": data.failure_rows,
            "rows": len(data.refs), "update_steps": len(history),
            "loss_first": history[0]["loss"] if history else None,
            "loss_last": history[-1]["loss"] if history else None,
            "judgments": [{"task": t.task_id, **j.as_dict(), **({"captions": c} if c is not None else {})}
                          for j, t, c in zip(judgments, rollouts, captions)]}
        if described is not None:
            report["captions_asked"], report["captions_unreadable"] = described.requests, described.unreadable
        if cur is not None:  # U_{p+1}, I_{p+1} for the next phase (Eq. 1)
            nxt = self.curriculum(ctx.streams.seed_for("curriculum")).update(
                cur, [(tasks[t.task_id], j) for t, j in zip(rollouts, judgments)])
            write_text_atomic(folder / "curriculum.json", json.dumps(nxt.to_json(), indent=1))
            report["tasks"] = len(tasks)
            report["next_tasks"] = len(nxt.tasks)
            report["guidebook"] = nxt.guidebook()
        if o.curriculum == "chat":  # U_{p+1}, I_{p+1} from Fig. 9 (Alg. 1 line 25)
            from guijax.seagent.chat_curriculum import phase_feedback

            descriptions, exam, states = phase_feedback(
                [(tasks[t.task_id], j, c or []) for t, j, c in zip(rollouts, judgments, captions)],
                o.curriculum_descriptions)
            document = json.loads(self.buffer_path(ctx, p).read_text())["software document new"]
            buffer = self.generator().update(descriptions, document, exam, states)
            nxt = self.chat_buffer(ctx, p + 1, buffer, self.scenes(ctx, engine))
            report["tasks"], report["next_tasks"], report["guidebook"] = len(tasks), len(nxt), buffer.document
        write_text_atomic(folder / "phase.json", json.dumps(report, indent=1))
        writer.write({k: v for k, v in report.items() if isinstance(v, (int, float)) and v is not None})
        return (f"judged {report['judged_correct']}/{report['episodes']} correct (verifier "
                f"{report['verified_successes']}), {report['a_T']} a_T and {report['a_F']} a_F steps, mean step reward "
                f"{report['mean_step_reward']:.2f}, {report['groups_kept']} groups kept, {report['rows']} rows"
                + (f", loss {report['loss_first']:.3f} -> {report['loss_last']:.3f}" if history else "")
                + (f"; next phase: {report['next_tasks']} tasks" if "next_tasks" in report else ""))

    def records(self, tasks: dict, rollouts: list) -> list:
        """Each episode's ground-truth record (guijax.seagent.captions.EpisodeRecord): the World State Model's
        state-change captions C step by step, and the final screen; None off the desk (the chat judge answers
        Fig. 8, which asks for no captions)."""
        if self.config.env.kind != "desk":
            return [None] * len(rollouts)
        from guijax.rollout.prompt import grammar_of
        from guijax.seagent.captions import desk_episode_record

        env = self.config.env
        return [desk_episode_record(tasks[t.task_id], t, tuple(env.screen), env.popups,
                                    self.config.rollout.coordinate_model, grammar_of(self.config.rollout.prompt))
                for t in rollouts]

    def describe(self) -> str:
        o = self.options
        return (f"{self.summary}; {o.phases} phase(s) of {o.episodes_per_task} episodes per task, G={o.group_size}, "
                f"γ={o.gamma} ({o.failure_loss}), judge {o.judge}")

