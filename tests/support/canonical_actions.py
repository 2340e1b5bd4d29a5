"""One canonical action per kind the relative-coordinate grammars (computer_use, pyautogui) write, on a small
screen, for their round-trip tests (a one-key PRESS and a multi-key HOTKEY are distinct kinds there)."""
from __future__ import annotations

from envs.actions.model import Action, ActionType

SCREEN = (280, 280)
CANONICAL = [
    Action(ActionType.CLICK, point=(26, 92)), Action(ActionType.RIGHT_SINGLE, point=(1, 279)),
    Action(ActionType.MIDDLE_SINGLE, point=(140, 3)), Action(ActionType.LEFT_DOUBLE, point=(279, 0)),
    Action(ActionType.LEFT_TRIPLE, point=(172, 32)), Action(ActionType.HOVER, point=(99, 201)),
    Action(ActionType.HOTKEY, keys=("ctrl", "shift", "t")), Action(ActionType.PRESS, keys=("enter",)),
    Action(ActionType.KEYDOWN, keys=("shift",)), Action(ActionType.KEYUP, keys=("shift",)),
    Action(ActionType.TYPE, text='a "quoted"\nline'), Action(ActionType.DRAG, point=(228, 52), end_point=(60, 52)),
    Action(ActionType.SCROLL, point=(172, 56), direction="down", amount=3.0),
    Action(ActionType.SCROLL, direction="up", amount=2.5),
    Action(ActionType.SCROLL, point=(10, 10), direction="left", amount=4.0),
    Action(ActionType.SCROLL, point=(10, 10), direction="right", amount=1.0),
    Action(ActionType.WAIT, amount=2.0), Action(ActionType.FINISHED), Action(ActionType.FAIL),
]
