"""The one typed action model that every surface grammar (UI-TARS text, S2-style, computer_use) maps onto.

Coordinates are always absolute screen pixels (x right, y down) once an action reaches this model:
the grammars own the conversion from model space (smart-resized pixels, 0-1000 relative) to screen.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ActionType(str, enum.Enum):
    """UI-TARS desktop + mobile action space plus the control outcomes WAIT / DONE / FAIL."""

    CLICK = "click"
    LEFT_DOUBLE = "left_double"
    LEFT_TRIPLE = "left_triple"  # computer_use triple_click
    RIGHT_SINGLE = "right_single"
    MIDDLE_SINGLE = "middle_single"  # computer_use middle_click
    HOVER = "hover"
    DRAG = "drag"
    HOTKEY = "hotkey"
    PRESS = "press"
    KEYDOWN = "keydown"
    KEYUP = "keyup"
    TYPE = "type"
    SCROLL = "scroll"
    LONG_PRESS = "long_press"
    PRESS_BACK = "press_back"
    PRESS_HOME = "press_home"
    PRESS_ENTER = "press_enter"
    # Control outcomes (OSWorld semantics: WAIT sleeps, DONE ends the episode, FAIL declares infeasible).
    WAIT = "wait"
    FINISHED = "finished"  # DONE
    FAIL = "fail"
    CALL_USER = "call_user"


CONTROL_TYPES = frozenset({ActionType.WAIT, ActionType.FINISHED, ActionType.FAIL, ActionType.CALL_USER})
TERMINAL_TYPES = frozenset({ActionType.FINISHED, ActionType.FAIL, ActionType.CALL_USER})


@dataclasses.dataclass(frozen=True)
class Action:
    """One executable action in screen pixels.

    Fields unused by a kind stay at their defaults:
      point:      target (click/hover/scroll/long_press, drag start)
      end_point:  drag end
      keys:       hotkey / press / keydown / keyup keys, lower-case pyautogui names
      text:       type content, finished(content=...) or call_user message
      direction:  scroll direction: up / down / left / right
      amount:     scroll clicks (pyautogui units) or wait seconds
      clipped:    a coordinate was outside the screen and was clipped to it
    """

    kind: ActionType
    point: tuple[int, int] | None = None
    end_point: tuple[int, int] | None = None
    keys: tuple[str, ...] = ()
    text: str = ""
    direction: str | None = None
    amount: float | None = None
    clipped: bool = False

    @property
    def is_terminal(self) -> bool:
        return self.kind in TERMINAL_TYPES


class ActionParseError(ValueError):
    """Model output that no grammar accepts. Carries the offending text so the trainer can log it and
    apply a format penalty instead of crashing the rollout; the message quotes a bounded excerpt of it."""

    def __init__(self, message: str, text: str):
        excerpt = text if len(text) <= 400 else f"{text[:200]}...{text[-200:]}"
        super().__init__(f"{message}: {excerpt!r}")
        self.text = text


# what a parser's arithmetic, recursion or a caller's bad size can raise on hostile text
_UNCLEAN = (ArithmeticError, RecursionError, MemoryError, ValueError, TypeError, KeyError, IndexError)


def only_parse_errors(parse: Callable[..., T]) -> Callable[..., T]:
    """Make a parser raise ActionParseError and nothing else, whatever the text: the rollout engine turns
    that error (and only it) into a format penalty, so any other exception would end training."""

    @functools.wraps(parse)
    def wrapper(text: str, *args: Any, **kwargs: Any) -> T:
        try:
            return parse(text, *args, **kwargs)
        except ActionParseError:
            raise
        except _UNCLEAN as err:
            raise ActionParseError(f"unparsable ({type(err).__name__}: {str(err)[:200]})", text) from None

    return wrapper
