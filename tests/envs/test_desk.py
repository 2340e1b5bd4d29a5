"""Synthetic desk: determinism, generation-as-validation for every family, expert traces, OSWorld control
semantics, dynamic pop-ups, and bad-input errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from envs.actions.model import Action, ActionType
from envs.actions.s2 import parse_s2
from envs.api import TaskError
from envs.desk import FAMILIES, DeskEnv, ExpertTrace, ScriptedExpert, run_expert
from envs.desk.a11y import GroundingError, ground, parse_tree
from envs.tasks import generate_desk_tasks


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(2 * len(FAMILIES), seed=3)


def test_every_family_passes_generation_as_validation(tasks):
    assert {t.domain for t in tasks} == set(FAMILIES)
    env = DeskEnv(popups=False)
    for task in tasks:
        env.reset(task)
        assert env.evaluate() == 0.0, task.id  # validator rejects the initial state
        assert run_expert(env, task, ScriptedExpert()).reward == 1.0, task.id


def test_difficulty_is_graded(tasks):
    env = DeskEnv(popups=False)
    lengths = {t.domain: len(run_expert(env, t, ScriptedExpert()).steps) for t in tasks}
    assert lengths["click_button"] == 2 and lengths["settings_then_note"] >= 8


def test_determinism_for_a_seed(tasks):
    a = generate_desk_tasks(6, seed=11)
    b = generate_desk_tasks(6, seed=11)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    e1, e2 = DeskEnv(seed=5), DeskEnv(seed=5)
    for task in tasks[:4]:
        o1, o2 = e1.reset(task), e2.reset(task)
        assert np.array_equal(o1.screenshot, o2.screenshot) and o1.a11y_tree == o2.a11y_tree


def test_expert_survives_popups_and_a_replayed_trace_does_not(tasks):
    """The dynamic UI the BEPA paper describes: replaying an expert's clicks blindly fails once a pop-up
    covers the target, while the expert (which re-reads the screen) succeeds."""
    task = next(t for t in tasks if t.domain == "fill_form")
    clean = run_expert(DeskEnv(popups=False), task, ScriptedExpert())
    env = DeskEnv(seed=0)
    for seed in range(40):
        env.reset(task, episode_seed=seed)
        if env.scene.popup is None:
            continue
        for step in clean.steps:
            env.step(step.actions)
        replay_score = env.evaluate()
        trace = run_expert(_SeededEnv(env, seed), task, ScriptedExpert())
        assert replay_score == 0.0 and trace.reward == 1.0
        assert any("pop-up" in s.s2 for s in trace.steps)
        return
    pytest.fail("no episode seed produced a pop-up")


class _SeededEnv:
    def __init__(self, env, seed):
        self.env, self.seed, self.step_limit = env, seed, env.step_limit

    def reset(self, task):
        return self.env.reset(task, episode_seed=self.seed)

    def step(self, a):
        return self.env.step(a)

    def evaluate(self):
        return self.env.evaluate()


def test_popup_blocks_clicks_until_closed(tasks):
    task = next(t for t in tasks if t.domain == "click_button")
    env = DeskEnv()
    for seed in range(50):
        obs = env.reset(task, episode_seed=seed)
        if env.scene.popup is not None:
            break
    target = task.extra["expert"][0]["target"]
    box = ground(obs.a11y_tree, f'the "{target}" button in the "Dialog" window')
    env.step(Action(ActionType.CLICK, point=((box[0] + box[2]) // 2, (box[1] + box[3]) // 2)))
    assert env.scene.window("Dialog").widget(target).clicks == 0  # swallowed by the modal pop-up
    close = ground(env.observe().a11y_tree, 'the "Close" button of the pop-up')
    env.step(Action(ActionType.CLICK, point=(close[0] + 2, close[1] + 2)))
    assert env.scene.popup is None


def test_infeasible_semantics(tasks):
    task = next(t for t in tasks if t.domain == "infeasible_toggle")
    feasible = next(t for t in tasks if t.domain == "toggle_checkbox")
    env = DeskEnv(popups=False)
    env.reset(task)
    assert env.step(Action(ActionType.FAIL)).done and env.evaluate() == 1.0
    env.reset(task)
    env.step(Action(ActionType.FINISHED))
    assert env.evaluate() == 0.0
    env.reset(feasible)
    run = run_expert(env, feasible, ScriptedExpert())
    assert run.reward == 1.0
    env.reset(feasible)
    env.step(Action(ActionType.FAIL))
    assert env.evaluate() == 0.0  # giving up on a feasible task scores 0


def test_step_limit(tasks):
    env = DeskEnv(step_limit=3, popups=False)
    env.reset(tasks[0])
    results = [env.step(Action(ActionType.WAIT)) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].info["step_limit"]


def test_trace_save_and_load(tasks, tmp_path):
    task = next(t for t in tasks if t.domain == "choose_option")
    trace = run_expert(DeskEnv(popups=False), task, ScriptedExpert())
    trace.save(tmp_path / "trace")
    loaded = ExpertTrace.load(tmp_path / "trace")
    assert loaded.plan == trace.plan and loaded.reward == 1.0
    assert [s.actions for s in loaded.steps] == [s.actions for s in trace.steps]
    assert np.array_equal(loaded.steps[0].screenshot, trace.steps[0].screenshot)
    assert parse_s2(loaded.steps[0].s2).name == "click"


@pytest.mark.parametrize("corrupt, message", [
    (lambda d, t: t.write_text(t.read_text()[:40]), "invalid JSON"),
    (lambda d, t: t.write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    (lambda d, t: _edit(t, lambda j: j.pop("steps")), "missing key 'steps'"),
    (lambda d, t: _edit(t, lambda j: j.update(reward="1")), "key 'reward' has type str"),
    (lambda d, t: _edit(t, lambda j: j["steps"].__setitem__(0, 7)), "step 0: expected a JSON object"),
    (lambda d, t: _edit(t, lambda j: j["steps"][0].pop("s2")), "step 0: missing key 's2'"),
    (lambda d, t: _edit(t, lambda j: j["steps"][0].update(s2="agent.click(")), "step 0: action 'agent.click\(' "
                                                                               "cannot be replayed"),
    (lambda d, t: _edit(t, lambda j: j["steps"][0].update(boxes=[])), "step 0: action .* cannot be replayed"),
    (lambda d, t: (d / json.loads(t.read_text())["steps"][0]["screenshot"]).unlink(), "step 0: cannot read screenshot"),
])
@pytest.mark.hostile
def test_a_corrupt_trace_is_refused_naming_the_file_and_the_field(tasks, tmp_path, corrupt, message):
    task = next(t for t in tasks if t.domain == "choose_option")
    run_expert(DeskEnv(popups=False), task, ScriptedExpert()).save(tmp_path / "trace")
    corrupt(tmp_path / "trace", tmp_path / "trace" / "trace.json")
    with pytest.raises(TaskError, match=message) as err:
        ExpertTrace.load(tmp_path / "trace")
    assert "trace.json" in str(err.value)


def _edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_noisy_expert_is_imperfect(tasks):
    env = DeskEnv(popups=False)
    hard = [t for t in tasks if t.domain in ("fill_form", "settings_then_note")]
    rewards = [run_expert(env, t, ScriptedExpert(noise=0.5, seed=s)).reward for t in hard for s in range(4)]
    assert min(rewards) == 0.0


def test_grounding_errors_name_the_description(tasks):
    obs = DeskEnv(popups=False).reset(tasks[0])
    assert parse_tree(obs.a11y_tree)[0].role == "window"
    with pytest.raises(GroundingError, match="cannot ground element description 'the moon'"):
        ground(obs.a11y_tree, "the moon")


def _center(box):
    return ((box[0] + box[2]) // 2, (box[1] + box[3]) // 2)


def _episode_with(env, task, want_banner: bool, want_popup: bool = False):
    for seed in range(200):
        obs = env.reset(task, episode_seed=seed)
        if (env.scene.banner is not None) == want_banner and (env.scene.popup is not None) == want_popup:
            return obs
    pytest.fail("no episode seed gave the wanted dynamic UI")


def test_banner_swallows_clicks_beneath_it_but_not_keys(tasks):
    task = next(t for t in tasks if t.domain == "type_field")
    env = DeskEnv()
    _episode_with(env, task, want_banner=True)
    field = env.scene.front.widgets[0]
    banner = env.scene.banner
    banner.rect = (0, field.rect[1] - 2, env.scene.width, field.rect[3] + 2)  # move it over the field
    env.scene.version += 1
    line = next(x for x in env.observe().a11y_tree.splitlines() if x.strip().startswith(f'field "{field.name}"'))
    assert line.endswith(" occluded")
    env.step(Action(ActionType.CLICK, point=_center(field.rect)))
    assert env.scene.focus is None  # the click landed on the banner
    env.step(Action(ActionType.CLICK, point=_center(ground(env.observe().a11y_tree,
                                                          'the "Dismiss" button of the notification banner'))))
    assert env.scene.banner is None
    env.step(Action(ActionType.CLICK, point=_center(field.rect)))
    env.scene.banner = banner  # a banner does not take the keyboard
    env.step(Action(ActionType.TYPE, text="zz"))
    assert field.text.endswith("zz")


def test_confirmation_dialog_only_ok_presses_the_button(tasks):
    task = next(t for t in tasks if t.domain == "confirm_action")
    target = task.extra["expert"][0]["target"]
    env = DeskEnv(popups=False)
    env.reset(task)
    button = env.scene.window("Account").widget(target)
    env.step(Action(ActionType.CLICK, point=_center(button.rect)))
    tree = env.observe().a11y_tree
    assert tree.startswith('alertdialog "Confirm"') and f"{target}: are you sure?" in tree
    env.step(Action(ActionType.CLICK, point=_center(button.rect)))  # modal: the window underneath is blocked
    env.step(Action(ActionType.CLICK, point=_center(ground(tree, 'the "Cancel" button of the confirmation dialog'))))
    assert env.scene.confirm is None and button.clicks == 0 and env.evaluate() == 0.0
    env.step(Action(ActionType.CLICK, point=_center(button.rect)))
    env.step(Action(ActionType.HOTKEY, keys=("esc",)))
    assert env.scene.confirm is None and button.clicks == 0
    env.step(Action(ActionType.CLICK, point=_center(button.rect)))
    env.step(Action(ActionType.PRESS_ENTER))
    assert button.clicks == 1 and env.evaluate() == 1.0


def test_expert_dismisses_a_banner_over_its_target(tasks):
    task = next(t for t in tasks if t.domain == "fill_form")
    env = DeskEnv(seed=0)
    for seed in range(300):
        trace = run_expert(_SeededEnv(env, seed), task, ScriptedExpert())
        if any("notification banner" in s.s2 for s in trace.steps):
            assert trace.reward == 1.0
            return
    pytest.fail("no episode seed put a banner over the expert's way")


def test_noise_gives_wrong_and_missed_actions(tasks):
    task = next(t for t in tasks if t.domain == "settings_then_note")
    env = DeskEnv(popups=False)
    s2 = [s.s2 for seed in range(6) for s in run_expert(env, task, ScriptedExpert(noise=0.4, seed=seed)).steps]
    assert any(a.startswith("agent.wait(") for a in s2)
    clean = run_expert(env, task, ScriptedExpert())
    assert not any(s.s2.startswith("agent.wait(") for s in clean.steps)


def test_the_noise_marks_its_own_steps_and_the_mark_survives_save_and_load(tasks, tmp_path):
    from envs.api import TaskError
    from envs.desk.expert import ExpertTrace

    task = next(t for t in tasks if t.domain == "settings_then_note")
    env = DeskEnv(popups=False)
    assert not any(s.injected for s in run_expert(env, task, ScriptedExpert()).steps)
    traces = [run_expert(env, task, ScriptedExpert(noise=0.4, seed=seed)) for seed in range(6)]
    steps = [s for t in traces for s in t.steps]
    assert all(s.injected for s in steps if s.s2.startswith("agent.wait("))  # a missed step is always the noise
    assert 0 < sum(s.injected for s in steps) < len(steps)
    noisy = next(t for t in traces if any(s.injected for s in t.steps))
    back = ExpertTrace.load(noisy.save(tmp_path / "trace"))
    assert [s.injected for s in back.steps] == [s.injected for s in noisy.steps]
    text = (tmp_path / "trace" / "trace.json").read_text().replace('"injected": false', '"injected": "no"', 1)
    (tmp_path / "trace" / "trace.json").write_text(text)
    with pytest.raises(TaskError, match="key 'injected' must be true or false"):
        ExpertTrace.load(tmp_path / "trace")
