"""SEAgent's verifiable step reward (Eq. 4, App. G Table 9): how close a sampled action is to a correct one.

    r(a, a_T) = 1[type(a) = type(a_T)] + r_dist(a, a_T),   r_dist in [0, 1]

r_dist by action type (Table 9), 0 when the types differ:

* click / left_double / right_single / hover / long_press (move_mouse, triple and middle clicks too):
  1 - normalised L1 distance between the points, (|dx| / width + |dy| / height) / 2.
* drag / select: intersection over union of the boxes the two drags span (start and end as corners; a box is
  at least one pixel wide and high so a click-like drag still has an area).
* type: character-level BLEU between the texts; hotkey / press / keydown / keyup: between the key combinations
  ("ctrl+c"); scroll: between the directions.
* wait, finished and the other argument-free outcomes (fail, call_user, press_back/home/enter): 1 (Table 9's
  "fixed reward + 1").

A response with several actions is compared position by position with the correct step's actions and the
rewards averaged over the longer list (a missing or extra action scores 0); for the one action per step
of the paper's steps this is Eq. 4 itself. An unparsable response scores 0.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

from envs.actions.model import Action, ActionType

_POINT_TYPES = frozenset({ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.LEFT_TRIPLE, ActionType.RIGHT_SINGLE,
                          ActionType.MIDDLE_SINGLE, ActionType.HOVER, ActionType.LONG_PRESS})
_KEY_TYPES = frozenset({ActionType.HOTKEY, ActionType.PRESS, ActionType.KEYDOWN, ActionType.KEYUP})
BLEU_ORDER = 4


@dataclasses.dataclass(frozen=True)
class StepReward:
    """Eq. 4 for one sampled response: `same_type` (the indicator), `distance` (r_dist), `total` (their sum,
    averaged over aligned actions for multi-action responses), and why a response scored 0 if it did."""

    same_type: float
    distance: float
    total: float
    reason: str = ""


def char_bleu(hypothesis: str, reference: str, max_order: int = BLEU_ORDER) -> float:
    """Sentence BLEU over characters, in [0, 1]. Orders run to min(max_order, both lengths) (short keys such
    as "up" have no 4-grams), a zero n-gram match is smoothed to 1 / (2^k * total) for the k-th such order,
    and the usual brevity penalty applies. Equal strings (the empty ones included) score 1."""
    if hypothesis == reference:
        return 1.0
    if not hypothesis or not reference:
        return 0.0
    order = min(max_order, len(hypothesis), len(reference))
    log_precisions, zeros = [], 0
    for n in range(1, order + 1):
        hyp = collections.Counter(hypothesis[i:i + n] for i in range(len(hypothesis) - n + 1))
        ref = collections.Counter(reference[i:i + n] for i in range(len(reference) - n + 1))
        matched = sum(min(count, ref[gram]) for gram, count in hyp.items())
        total = sum(hyp.values())
        if matched == 0:
            zeros += 1
            log_precisions.append(math.log(1.0 / (2 ** zeros * total)))
        else:
            log_precisions.append(math.log(matched / total))
    brevity = min(0.0, 1.0 - len(reference) / len(hypothesis))
    return float(math.exp(brevity + sum(log_precisions) / order))


def _l1_closeness(a: tuple[int, int], b: tuple[int, int], screen_hw: tuple[int, int]) -> float:
    height, width = screen_hw
    distance = (abs(a[0] - b[0]) / width + abs(a[1] - b[1]) / height) / 2.0
    return max(0.0, 1.0 - distance)


def _box(action: Action) -> tuple[int, int, int, int]:
    (x0, y0), (x1, y1) = action.point, action.end_point
    return min(x0, x1), min(y0, y1), max(x0, x1) + 1, max(y0, y1) + 1


def box_iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    """IoU of two (left, top, right, bottom) boxes."""
    width = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def distance_reward(pred: Action, truth: Action, screen_hw: tuple[int, int]) -> float:
    """Table 9's r_dist for two actions of the same type (0 for different types)."""
    if pred.kind != truth.kind:
        return 0.0
    kind = truth.kind
    if kind in _POINT_TYPES:
        if pred.point is None or truth.point is None:
            return float(pred.point == truth.point)
        return _l1_closeness(pred.point, truth.point, screen_hw)
    if kind == ActionType.DRAG:
        return box_iou(_box(pred), _box(truth))
    if kind == ActionType.TYPE:
        return char_bleu(pred.text, truth.text)
    if kind in _KEY_TYPES:
        return char_bleu("+".join(pred.keys), "+".join(truth.keys))
    if kind == ActionType.SCROLL:
        return char_bleu(pred.direction or "", truth.direction or "")
    return 1.0  # wait, finished, fail, call_user and the argument-free mobile keys: a fixed reward


def step_reward(pred: Sequence[Action] | None, truth: Sequence[Action], screen_hw: tuple[int, int]) -> StepReward:
    """Eq. 4 between a sampled response's actions (None: unparsable) and the correct step's actions."""
    if pred is None:
        return StepReward(0.0, 0.0, 0.0, "unparsable response")
    if not truth:
        raise ValueError("the correct step a_T has no action to compare with")
    length = max(len(pred), len(truth))
    same = dist = 0.0
    for p, t in zip(pred, truth):
        if p.kind == t.kind:
            same += 1.0
            dist += distance_reward(p, t, screen_hw)
    reason = "" if same else f"action type {pred[0].kind.value if pred else 'none'} is not {truth[0].kind.value}"
    return StepReward(same / length, dist / length, (same + dist) / length, reason)
