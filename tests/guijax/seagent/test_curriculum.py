"""SEAgent's offline curriculum on the desk (Eq. 1): the guidebook and the next task set from judged results."""
from __future__ import annotations

import json

import pytest

from envs.desk.env import DeskEnv
from envs.tasks import generate_desk_tasks
from guijax.seagent.curriculum import Curriculum, DeskCurriculum
from guijax.seagent.world_state import Judgment

SCREEN = (280, 280)
LADDER = ("click_button", "toggle_checkbox", "choose_option", "set_slider", "pick_from_list")


@pytest.fixture(scope="module")
def start():
    tasks = generate_desk_tasks(4, seed=1, families=["click_button", "toggle_checkbox"], screen_hw=SCREEN)
    return tasks, DeskCurriculum(LADDER, SCREEN, tasks_per_phase=6, seed=3)


def test_mastery_moves_the_frontier_and_failures_are_retried(start):
    tasks, gen = start
    cur = gen.initial(tasks)
    assert cur.tasks == tasks and "choose_option (difficulty 2): not tried" in cur.guidebook()
    results = [(t, Judgment(t.domain == "click_button", error_type="" if t.domain == "click_button" else "missed it"))
               for t in tasks for _ in range(2)]
    nxt = gen.update(cur, results)
    failed = [t.id for t in tasks if t.domain == "toggle_checkbox"]
    assert nxt.phase == 2 and [t.id for t in nxt.tasks[:2]] == failed  # retries first, at most half of 6
    new = nxt.tasks[2:]
    assert len(new) == 4 and {t.domain for t in new} == {"choose_option", "set_slider", "toggle_checkbox"}
    assert len({t.id for t in nxt.tasks}) == 6 and all(t.id.endswith("-p2") for t in new)
    env = DeskEnv(SCREEN)
    for t in new:  # every generated task has a validator that rejects the untouched screen
        env.reset(t)
        assert t.evaluator and env.evaluate() == 0.0
    book = nxt.guidebook().splitlines()
    assert book[0] == "click_button (difficulty 1): mastered, judged correct 4/4"
    assert book[1] == "toggle_checkbox (difficulty 1): learning, judged correct 0/4; errors seen: missed it"
    back = Curriculum.from_json(json.loads(json.dumps(nxt.to_json())))
    assert back.guidebook() == nxt.guidebook() and [t.to_dict() for t in back.tasks] == [t.to_dict() for t in nxt.tasks]


def test_nothing_mastered_keeps_to_the_families_being_learnt(start):
    tasks, gen = start
    nxt = gen.update(gen.initial(tasks), [(t, Judgment(False)) for t in tasks])
    assert len(nxt.tasks) == 6 and [t.id for t in nxt.tasks[:3]] == [t.id for t in tasks[:3]]  # half: retries
    assert {t.domain for t in nxt.tasks[3:]} <= {"click_button", "toggle_checkbox"}


def test_unknown_families_are_named():
    with pytest.raises(ValueError, match=r"curriculum_families names \['paint'\]"):
        DeskCurriculum(("click_button", "paint"), SCREEN, 4)
