"""SEAgent's state-change captions on the desk: accessibility-tree differences in words, and one caption per
replayed step of a real desk episode."""
from __future__ import annotations

import pytest

from desk_policies import DONE, SCREEN, WAIT, buttons, click, click_task, scripted_episodes
from envs.actions.model import Action, ActionType
from envs.desk.a11y import parse_tree
from envs.desk.env import DeskEnv
from envs.tasks import generate_desk_tasks
from guijax.seagent.captions import change_caption, desk_episode_record

BEFORE = '''window "Notes" [0,0,100,100]
  field "Title" [5,5,95,20] text="draft"
window "Settings" [0,0,200,200] front
  checkbox "Wi-Fi" [5,5,50,20] checked=True
  slider "Volume" [5,25,95,40] value=30'''


def test_tree_differences_are_named_control_by_control():
    after = '''dialog "Tip" [10,10,90,50] message="Try the new editor"
  button "Close" [70,12,88,24]
window "Notes" [0,0,100,100] front
  field "Title" [5,5,95,20] text="final"
window "Settings" [0,0,200,200]
  checkbox "Wi-Fi" [5,5,50,20] checked=False
  slider "Volume" [5,25,95,40] value=70
window "Log" [0,0,50,50]'''
    assert change_caption(BEFORE, after) == (
        'A pop-up appeared saying "Try the new editor"; the "Log" window opened; the "Notes" window came to the '
        'front; the "Title" field in the "Notes" window now reads "final"; the "Wi-Fi" checkbox in the "Settings" '
        'window is now unchecked; the "Volume" slider in the "Settings" window now shows 70%.')
    assert change_caption(after, BEFORE).startswith("The pop-up closed; the \"Log\" window closed")
    assert change_caption(BEFORE, BEFORE) == "The screen did not change."
    scrolled = ('window "Files" [0,0,100,100] front\n  list "Docs" [5,5,95,60] selected="" visible=[\'a\', \'b\'] '
                "items=['a', 'b', 'c']")
    assert change_caption(scrolled, scrolled.replace('selected=""', 'selected="c"').replace("visible=['a', 'b']",
                                                                                         "visible=['b', 'c']")) == (
        'The "Docs" list in the "Files" window now selects "c"; the "Docs" list in the "Files" window scrolled to '
        "show ['b', 'c'].")
    assert change_caption(BEFORE, BEFORE, ["the \"Save\" button registered a click"]) == \
        'The "Save" button registered a click.'


def _center(tree: str, role: str) -> tuple[int, int]:
    node = next(n for n in parse_tree(tree) if n.role == role)
    return (node.rect[0] + node.rect[2]) // 2, (node.rect[1] + node.rect[3]) // 2


@pytest.mark.parametrize("family,expected", [
    ("toggle_checkbox", "checkbox in the"),
    ("choose_option", "dropdown in the"),
])
def test_a_real_desk_step_is_captioned_from_its_trees(family, expected):
    task = generate_desk_tasks(1, seed=1, families=[family], screen_hw=SCREEN)[0]
    env = DeskEnv(SCREEN, popups=False)
    before = env.reset(task).a11y_tree
    role = "checkbox" if family == "toggle_checkbox" else "dropdown"
    after = env.step(Action(ActionType.CLICK, point=_center(before, role))).observation.a11y_tree
    caption = change_caption(before, after)
    name = next(n.name for n in parse_tree(before) if n.role == role)
    assert f'The "{name}" {expected}' in caption
    assert ("now unchecked" in caption or "now checked" in caption) if role == "checkbox" else \
        "opened its options" in caption


@pytest.fixture(scope="module")
def task():
    return click_task()


def test_every_replayed_step_of_an_episode_gets_a_caption(task):
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    with scripted_episodes(task) as run:
        detour = run([click(task, wrong), click(task, target), DONE])
        broken = run([WAIT, "no action here"])
    assert desk_episode_record(task, detour, SCREEN).captions == [
        f'Step 1: clicked the "{wrong}" button in the "Dialog" window. The "{wrong}" button in the "Dialog" window '
        'registered a click.',
        f'Step 2: clicked the "{target}" button in the "Dialog" window. The "{target}" button in the "Dialog" '
        'window registered a click.',
        "Step 3: reported the task done. The screen did not change."]
    assert desk_episode_record(task, broken, SCREEN).captions == [
        "Step 1: waited. The screen did not change.", "Step 2: the answer did not parse; the episode ended."]
