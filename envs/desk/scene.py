"""The synthetic desk's state: windows holding widgets, pop-ups, focus, and how actions change them.

Pure Python state (no drawing here: render.py draws it, a11y.py describes it). Widgets are addressed by
their accessible name, unique within a window; the whole state serialises to a plain dict so validators
compare it with an expected dict.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

Rect = tuple[int, int, int, int]  # x1, y1, x2, y2 (x2, y2 exclusive)

TITLE_H = 16
ROW_H = 20
LIST_ROWS = 4


def inside(rect: Rect, point: tuple[int, int]) -> bool:
    return rect[0] <= point[0] < rect[2] and rect[1] <= point[1] < rect[3]


@dataclasses.dataclass
class Widget:
    kind: str  # button | checkbox | field | dropdown | list | slider | label
    name: str
    rect: Rect = (0, 0, 0, 0)
    text: str = ""  # field content / label text
    checked: bool = False
    clicks: int = 0  # button presses
    options: tuple[str, ...] = ()  # dropdown options / list items
    value: Any = None  # dropdown choice, list selection, slider 0-100
    open: bool = False  # dropdown expanded
    offset: int = 0  # list scroll offset
    select_all: bool = False  # field: next typing replaces the content
    confirm: str = ""  # button: ask this question in a confirmation dialog; only OK counts as a press

    def state(self) -> dict[str, Any]:
        if self.kind == "button":
            return {"clicks": self.clicks}
        if self.kind == "checkbox":
            return {"checked": self.checked}
        if self.kind == "field":
            return {"text": self.text}
        if self.kind in ("dropdown", "list", "slider"):
            return {"value": self.value}
        return {}

    def option_rects(self) -> list[Rect]:
        """Dropdown rows when open, drawn below the box."""
        x1, y1, x2, y2 = self.rect
        return [(x1, y2 + i * (ROW_H - 4), x2, y2 + (i + 1) * (ROW_H - 4)) for i in range(len(self.options))]

    def row_rects(self) -> list[tuple[int, Rect]]:
        """Visible list rows as (item index, rect)."""
        x1, y1, x2, _ = self.rect
        h = ROW_H - 4
        rows = range(self.offset, min(self.offset + LIST_ROWS, len(self.options)))
        return [(i, (x1, y1 + (i - self.offset) * h, x2, y1 + (i - self.offset + 1) * h)) for i in rows]

    def slider_track(self) -> tuple[int, int]:
        return self.rect[0] + 4, self.rect[2] - 4

    def knob_x(self) -> int:
        lo, hi = self.slider_track()
        return lo + round((hi - lo) * (self.value or 0) / 100)


@dataclasses.dataclass
class Window:
    title: str
    rect: Rect
    widgets: list[Widget]
    saved: int = 0  # ctrl+s presses while this window had focus

    @property
    def title_rect(self) -> Rect:
        return (self.rect[0], self.rect[1], self.rect[2], self.rect[1] + TITLE_H)

    def widget(self, name: str) -> Widget:
        for w in self.widgets:
            if w.name == name:
                return w
        raise KeyError(f"window {self.title!r} has no widget {name!r}")


@dataclasses.dataclass
class Popup:
    title: str
    message: str
    rect: Rect

    @property
    def close_rect(self) -> Rect:
        x1, y1, x2, y2 = self.rect
        return (x2 - 52, y2 - 22, x2 - 6, y2 - 6)


@dataclasses.dataclass
class Banner:
    """A non-modal notification strip across the screen: it swallows input that lands on it (covering the
    widgets beneath) until dismissed with its "x" button; keys still reach the focused field."""

    message: str
    rect: Rect

    @property
    def close_rect(self) -> Rect:
        x1, y1, x2, y2 = self.rect
        return (x2 - 20, y1 + 2, x2 - 4, y2 - 2)


@dataclasses.dataclass
class Confirm:
    """The modal confirmation dialog opened by a button with `confirm` set: OK (or Enter) presses the
    button, Cancel (or Esc) closes the dialog without pressing it."""

    window: str
    button: str
    message: str
    rect: Rect

    @property
    def ok_rect(self) -> Rect:
        x1, y1, x2, y2 = self.rect
        return (x2 - 98, y2 - 22, x2 - 56, y2 - 6)

    @property
    def cancel_rect(self) -> Rect:
        x1, y1, x2, y2 = self.rect
        return (x2 - 52, y2 - 22, x2 - 6, y2 - 6)


BANNER_MESSAGES = ("Backup finished.", "3 new messages", "Sale: 50% off today", "Storage almost full",
                   "New sign-in detected")

POPUP_MESSAGES = (("Update available", "Restart to update?"), ("Cookie notice", "We use cookies."),
                  ("Verify you are human", "Press Close to go on."), ("Newsletter", "Subscribe today!"),
                  ("Low battery", "Plug in your laptop."))


def layout_window(title: str, rect: Rect, specs: list[dict[str, Any]]) -> Window:
    """Stack widgets vertically inside the window's client area, one row each (lists take LIST_ROWS rows)."""
    x1, y1, x2, _ = rect
    y = y1 + TITLE_H + 4
    widgets = []
    for spec in specs:
        kind, name = spec["kind"], spec["name"]
        label_w = 0 if kind in ("button", "checkbox", "label") else min(64, (x2 - x1) // 3)
        left = x1 + 6 + label_w
        if kind == "button":
            w_rect = (left, y, min(x2 - 6, left + 8 + 6 * len(name)), y + ROW_H - 4)
        elif kind == "list":
            w_rect = (left, y, x2 - 6, y + LIST_ROWS * (ROW_H - 4))
        else:
            w_rect = (left, y, x2 - 6, y + ROW_H - 4)
        widget = Widget(kind=kind, name=name, rect=w_rect, text=spec.get("text", ""),
                        checked=spec.get("checked", False), options=tuple(spec.get("options", ())),
                        value=spec.get("value"), confirm=spec.get("confirm", ""))
        widgets.append(widget)
        y = w_rect[3] + 4
    return Window(title, rect, widgets)


class Scene:
    """All windows (last = front), an optional pop-up, focus, and the effect of each input event."""

    def __init__(self, windows: list[Window], size: tuple[int, int], rng: random.Random,
                 popup_prob: float = 0.0, popup_step_prob: float = 0.0,
                 banner_prob: float = 0.0, banner_step_prob: float = 0.0):
        self.windows = windows
        self.height, self.width = size
        self.rng = rng
        self.popup_prob, self.popup_step_prob = popup_prob, popup_step_prob
        self.banner_prob, self.banner_step_prob = banner_prob, banner_step_prob
        self.popup: Popup | None = None
        self.banner: Banner | None = None
        self.confirm: Confirm | None = None
        self.focus: tuple[str, str] | None = None  # (window title, widget name)
        self.popups_seen = 0
        self.version = 0  # bumped on every visible change; the renderer caches on it
        if rng.random() < popup_prob:
            self.spawn_popup()
        if banner_prob > 0 and rng.random() < banner_prob:  # no draw without banners: older episodes replay
            self.spawn_banner()

    # ------------------------------------------------------------------ queries
    @property
    def front(self) -> Window:
        return self.windows[-1]

    def window(self, title: str) -> Window:
        for w in self.windows:
            if w.title == title:
                return w
        raise KeyError(f"no window {title!r}")

    def focused_widget(self) -> Widget | None:
        if self.focus is None:
            return None
        return self.window(self.focus[0]).widget(self.focus[1])

    def state(self) -> dict[str, Any]:
        return {"windows": {w.title: {"saved": w.saved, "widgets": {x.name: x.state() for x in w.widgets if x.state()}}
                            for w in self.windows},
                "front": self.front.title, "popup": self.popup is not None, "dialog": self.confirm is not None}

    def window_at(self, point: tuple[int, int]) -> Window | None:
        for w in reversed(self.windows):
            if inside(w.rect, point):
                return w
        return None

    # ------------------------------------------------------------------ dynamics
    def spawn_popup(self) -> None:
        title, message = self.rng.choice(POPUP_MESSAGES)
        w, h = min(180, self.width - 20), 70
        x = self.rng.randint(5, max(5, self.width - w - 5))
        y = self.rng.randint(TITLE_H + 10, max(TITLE_H + 10, self.height - h - 5))
        self.popup = Popup(title, message, (x, y, x + w, y + h))
        self.popups_seen += 1
        self.version += 1

    def spawn_banner(self) -> None:
        y = self.rng.randint(TITLE_H + 6, max(TITLE_H + 6, self.height - 26))
        self.banner = Banner(self.rng.choice(BANNER_MESSAGES), (0, y, self.width, y + 20))
        self.version += 1

    def after_step(self) -> None:
        if self.popup is None and self.rng.random() < self.popup_step_prob:
            self.spawn_popup()
        if self.banner_step_prob > 0 and self.banner is None and self.rng.random() < self.banner_step_prob:
            self.spawn_banner()

    def _blocked(self, point: tuple[int, int]) -> bool:
        """Pointer input that a pop-up, confirmation dialog or banner takes instead of the windows."""
        return (self.popup is not None or self.confirm is not None
                or (self.banner is not None and inside(self.banner.rect, point)))

    def _answer_confirm(self, ok: bool) -> None:
        c = self.confirm
        if ok:
            self.window(c.window).widget(c.button).clicks += 1
        self.confirm = None

    def _open_confirm(self, win: Window, w: Widget) -> None:
        bw, bh = min(200, self.width - 20), 64
        x, y = (self.width - bw) // 2, max(TITLE_H + 4, (self.height - bh) // 2)
        self.confirm = Confirm(win.title, w.name, w.confirm, (x, y, x + bw, y + bh))

    def _close_menus(self, keep: Widget | None = None) -> None:
        for w in self.windows:
            for x in w.widgets:
                if x.kind == "dropdown" and x.open and x is not keep:
                    x.open = False

    def click(self, point: tuple[int, int], button: str = "left", count: int = 1) -> None:
        """A click reaches the pop-up first (it is modal), then an open dropdown menu, then the front-most
        window under the pointer; clicking a background window raises it."""
        self.version += 1
        if self.popup is not None:
            if button == "left" and inside(self.popup.close_rect, point):
                self.popup = None
            return
        if self.confirm is not None:
            if button == "left" and inside(self.confirm.ok_rect, point):
                self._answer_confirm(True)
            elif button == "left" and inside(self.confirm.cancel_rect, point):
                self._answer_confirm(False)
            return
        if self.banner is not None and inside(self.banner.rect, point):
            if button == "left" and inside(self.banner.close_rect, point):
                self.banner = None
            return
        for win in self.windows:
            for w in win.widgets:
                if w.kind == "dropdown" and w.open:
                    for option, rect in zip(w.options, w.option_rects()):
                        if inside(rect, point):
                            w.value, w.open = option, False
                            return
        self._close_menus()
        win = self.window_at(point)
        if win is None:
            self.focus = None
            return
        if win is not self.front:
            self.windows.remove(win)
            self.windows.append(win)
        if button != "left":
            return
        for w in win.widgets:
            if not inside(w.rect, point):
                continue
            if w.kind == "button" and w.confirm:
                self._open_confirm(win, w)
            elif w.kind == "button":
                w.clicks += 1
            elif w.kind == "checkbox":
                w.checked = not w.checked
            elif w.kind == "field":
                self.focus = (win.title, w.name)
                w.select_all = count >= 2 and bool(w.text)
            elif w.kind == "dropdown":
                w.open = not w.open
            elif w.kind == "list":
                for index, rect in w.row_rects():
                    if inside(rect, point):
                        w.value = w.options[index]
            elif w.kind == "slider":
                self._set_slider(w, point[0])
            return

    def _set_slider(self, w: Widget, x: int) -> None:
        lo, hi = w.slider_track()
        w.value = int(round(100 * (min(max(x, lo), hi) - lo) / (hi - lo)))

    def drag(self, start: tuple[int, int], end: tuple[int, int]) -> None:
        """Dragging a slider's knob (or anywhere on its track) moves it to the release point."""
        self.version += 1
        if self._blocked(start):
            return
        win = self.window_at(start)
        if win is None or win is not self.front:
            return
        for w in win.widgets:
            if w.kind == "slider" and inside(w.rect, start):
                self._set_slider(w, end[0])

    def scroll(self, point: tuple[int, int] | None, direction: str, amount: float) -> None:
        self.version += 1
        if point is None or self._blocked(point):
            return
        win = self.window_at(point)
        if win is None:
            return
        for w in win.widgets:
            if w.kind == "list" and inside(w.rect, point):
                rows = max(1, int(round(amount))) if amount else 1  # one row per scroll click
                delta = rows if direction == "down" else -rows if direction == "up" else 0
                w.offset = min(max(0, w.offset + delta), max(0, len(w.options) - LIST_ROWS))

    def type_text(self, text: str) -> None:
        self.version += 1
        w = self.focused_widget()
        if self.popup is not None or self.confirm is not None or w is None:
            return
        body = text[:-1] if text.endswith("\n") else text
        w.text = body if w.select_all else w.text + body
        w.select_all = False

    def key(self, keys: tuple[str, ...]) -> None:
        self.version += 1
        if self.popup is not None:
            if keys in (("esc",), ("enter",)):
                self.popup = None
            return
        if self.confirm is not None:
            if keys in (("esc",), ("enter",)):
                self._answer_confirm(keys == ("enter",))
            return
        w = self.focused_widget()
        if keys == ("ctrl", "s"):
            self.front.saved += 1
        elif keys == ("ctrl", "a") and w is not None:
            w.select_all = True
        elif keys == ("backspace",) and w is not None:
            w.text = "" if w.select_all else w.text[:-1]
            w.select_all = False
        elif keys == ("tab",):
            fields = [(win.title, x.name) for win in [self.front] for x in win.widgets if x.kind == "field"]
            if fields:
                i = fields.index(self.focus) + 1 if self.focus in fields else 0
                self.focus = fields[i % len(fields)]
        elif keys == ("esc",):
            self._close_menus()
