"""SEAgent's step reward (Eq. 4, Table 9) on UI-TARS responses parsed as the trainer parses them."""
from __future__ import annotations

import math

import pytest

from envs.actions import parse_uitars
from envs.actions.model import Action, ActionType
from guijax.seagent.rewards import box_iou, char_bleu, distance_reward, step_reward

SCREEN = (100, 200)  # height, width


def act(text: str):
    return parse_uitars(f"Thought: t\nAction: {text}", image_hw=SCREEN, screen_hw=SCREEN)


def test_char_bleu_by_hand_and_its_edges():
    # 1-grams 3/4, 2-grams 2/3, 3-grams 1/2, 4-grams 0/1 smoothed to 1/2: (3/4 * 2/3 * 1/2 * 1/2) ** (1/4)
    assert char_bleu("abcd", "abce") == pytest.approx((0.75 * 2 / 3 * 0.5 * 0.5) ** 0.25)
    assert char_bleu("hello", "hello") == 1.0 and char_bleu("", "") == 1.0
    assert char_bleu("", "x") == 0.0 and char_bleu("x", "") == 0.0
    assert char_bleu("up", "up") == 1.0 and char_bleu("up", "down") < 0.2
    short = char_bleu("hell", "hello")  # brevity penalty: exp(1 - 5/4)
    assert short == pytest.approx(math.exp(1 - 5 / 4))
    assert 0.0 <= char_bleu("ctrl+v", "ctrl+c") < 1.0


def test_points_score_by_normalised_l1_and_drags_by_iou():
    truth = act("click(start_box='(100,50)')")  # parsed from a response, in screen pixels
    assert step_reward(truth, truth, SCREEN).total == 2.0
    click = lambda x, y: [Action(ActionType.CLICK, point=(x, y))]  # noqa: E731
    near = step_reward(click(120, 50), click(100, 50), SCREEN)
    assert (near.same_type, near.distance) == (1.0, pytest.approx(1 - (20 / 200) / 2))
    corner = distance_reward(click(0, 0)[0], click(199, 99)[0], SCREEN)
    assert corner == pytest.approx(1 - (199 / 200 + 99 / 100) / 2)
    drag = [Action(ActionType.DRAG, point=(10, 10), end_point=(50, 30))]
    shifted = [Action(ActionType.DRAG, point=(70, 30), end_point=(30, 10))]  # drawn the other way round
    assert step_reward(act("drag(start_box='(10,10)', end_box='(50,30)')"), act("drag(start_box='(10,10)', "
                                                                               "end_box='(50,30)')"), SCREEN).total == 2.0
    assert distance_reward(shifted[0], drag[0], SCREEN) == pytest.approx(box_iou((30, 10, 71, 31), (10, 10, 51, 31)))
    assert distance_reward(shifted[0], drag[0], SCREEN) == pytest.approx(21 * 21 / (41 * 21 * 2 - 21 * 21))
    assert box_iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)
    assert box_iou((0, 0, 1, 1), (5, 5, 6, 6)) == 0.0


def test_text_keys_scroll_and_fixed_rewards():
    assert step_reward(act("type(content='hello')"), act("type(content='hello')"), SCREEN).total == 2.0
    typo = step_reward(act("type(content='helo')"), act("type(content='hello')"), SCREEN)
    assert typo.same_type == 1.0 and 0.0 < typo.distance < 1.0
    keys = step_reward(act("hotkey(key='ctrl v')"), act("hotkey(key='ctrl c')"), SCREEN)
    assert keys.same_type == 1.0 and 0.0 < keys.distance < 1.0
    scroll = act("scroll(start_box='(5,5)', direction='down')")
    assert step_reward(act("scroll(start_box='(90,90)', direction='down')"), scroll, SCREEN).total == 2.0
    assert step_reward(act("scroll(start_box='(5,5)', direction='up')"), scroll, SCREEN).distance < 0.5
    assert step_reward(act("wait()"), act("wait()"), SCREEN).total == 2.0
    assert step_reward(act("finished(content='x')"), act("finished(content='y')"), SCREEN).total == 2.0


def test_other_types_and_unparsable_responses_score_zero():
    truth = act("click(start_box='(100,50)')")
    wrong = step_reward(act("type(content='a')"), truth, SCREEN)
    assert (wrong.total, wrong.distance) == (0.0, 0.0) and "type is not click" in wrong.reason
    assert step_reward(act("left_double(start_box='(100,50)')"), truth, SCREEN).total == 0.0
    assert step_reward(None, truth, SCREEN).reason == "unparsable response"
    with pytest.raises(ValueError, match="no action"):
        step_reward(truth, [], SCREEN)


def test_multi_action_responses_average_over_the_longer_list():
    truth = [Action(ActionType.CLICK, point=(10, 10)), Action(ActionType.TYPE, text="abc")]
    assert step_reward(truth, truth, SCREEN).total == 2.0
    half = step_reward(truth[:1], truth, SCREEN)  # the typed text is missing: 2 of 4 points
    assert half.total == 1.0 and half.same_type == 0.5
