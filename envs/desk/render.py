"""Pillow rendering of a Scene into an RGB uint8 screenshot, and its accessibility tree as text.

The a11y tree lists what a person could see: the pop-up, confirmation dialog and banner (if any) first, then windows front to back with
their visible widgets, one line each: `role "name" [x1,y1,x2,y2] state`. Widgets hidden behind another
window or under the pop-up, dialog or banner are still listed (as OSWorld's tree lists them) but marked `occluded`.
"""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from envs.desk.scene import TITLE_H, Rect, Scene, Widget, inside

BG = (58, 110, 165)
WINDOW = (236, 236, 236)
TITLE_FRONT = (40, 60, 110)
TITLE_BACK = (120, 125, 140)
INK = (20, 20, 20)
FIELD = (255, 255, 255)
ACCENT = (30, 120, 220)
_FONT = ImageFont.load_default()
_GLYPHS: dict[str, tuple[Image.Image, int, int]] = {}


def _text(image: Image.Image, xy: tuple[int, int], text: str, fill) -> None:
    """Text through a cache of rendered masks: font rasterisation is most of the frame time, and the desk
    shows the same few strings over and over."""
    if not text:
        return
    entry = _GLYPHS.get(text)
    if entry is None:
        x1, y1, x2, y2 = _FONT.getbbox(text)
        mask = Image.new("L", (max(1, x2 - x1), max(1, y2 - y1)))
        ImageDraw.Draw(mask).text((-x1, -y1), text, fill=255, font=_FONT)
        entry = _GLYPHS[text] = (mask, x1, y1)
        if len(_GLYPHS) > 4096:
            _GLYPHS.clear()
    mask, dx, dy = entry
    image.paste(fill, (xy[0] + dx, xy[1] + dy), mask)


def _label(image: Image.Image, w: Widget) -> None:
    if w.kind not in ("button", "checkbox", "label"):
        _text(image, (w.rect[0] - 60, w.rect[1] + 2), w.name[:10], INK)


def _draw_widget(image: Image.Image, draw: ImageDraw.ImageDraw, w: Widget, focused: bool) -> None:
    x1, y1, x2, y2 = w.rect
    _label(image, w)
    if w.kind == "button":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=(214, 214, 220), outline=INK)
        _text(image, (x1 + 4, y1 + 2), w.name, INK)
    elif w.kind == "checkbox":
        draw.rectangle((x1, y1 + 2, x1 + 11, y1 + 13), fill=FIELD, outline=INK)
        if w.checked:
            draw.line((x1 + 2, y1 + 8, x1 + 5, y1 + 11, x1 + 10, y1 + 3), fill=ACCENT, width=2)
        _text(image, (x1 + 16, y1 + 2), w.name, INK)
    elif w.kind == "field":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=FIELD, outline=ACCENT if focused else INK)
        text = w.text[-((x2 - x1 - 6) // 6):]
        if w.select_all and text:
            draw.rectangle((x1 + 2, y1 + 2, x1 + 4 + 6 * len(text), y2 - 3), fill=(170, 200, 245))
        _text(image, (x1 + 3, y1 + 2), text + ("|" if focused else ""), INK)
    elif w.kind == "dropdown":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=FIELD, outline=INK)
        _text(image, (x1 + 3, y1 + 2), str(w.value or "Choose..."), INK)
        draw.polygon(((x2 - 12, y1 + 5), (x2 - 4, y1 + 5), (x2 - 8, y1 + 10)), fill=INK)
    elif w.kind == "list":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=FIELD, outline=INK)
        for index, (rx1, ry1, rx2, ry2) in w.row_rects():
            if w.options[index] == w.value:
                draw.rectangle((rx1 + 1, ry1, rx2 - 2, ry2 - 1), fill=(170, 200, 245))
            _text(image, (rx1 + 3, ry1 + 2), w.options[index], INK)
        if len(w.options) > 4:
            total = len(w.options)
            h = y2 - y1
            top = y1 + h * w.offset // total
            draw.rectangle((x2 - 5, top, x2 - 2, top + max(4, h * 4 // total)), fill=(120, 120, 120))
    elif w.kind == "slider":
        lo, hi = w.slider_track()
        mid = (y1 + y2) // 2
        draw.line((lo, mid, hi, mid), fill=INK, width=2)
        kx = w.knob_x()
        draw.rectangle((kx - 3, y1 + 1, kx + 3, y2 - 2), fill=ACCENT)
    elif w.kind == "label":
        _text(image, (x1, y1 + 2), w.text or w.name, INK)


def _draw_menu(image: Image.Image, draw: ImageDraw.ImageDraw, w: Widget) -> None:
    for option, (x1, y1, x2, y2) in zip(w.options, w.option_rects()):
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=(250, 250, 250), outline=(150, 150, 150))
        _text(image, (x1 + 3, y1 + 2), option, INK)


class Renderer:
    """Draws a scene; re-renders only when the scene's version changed since the last call."""

    def __init__(self):
        self._key: tuple[int, int] | None = None
        self._frame: np.ndarray | None = None

    def __call__(self, scene: Scene) -> np.ndarray:
        key = (id(scene), scene.version)
        if key == self._key and self._frame is not None:
            return self._frame
        image = Image.new("RGB", (scene.width, scene.height), BG)
        draw = ImageDraw.Draw(image)
        focus = scene.focused_widget()
        for win in scene.windows:
            x1, y1, x2, y2 = win.rect
            draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=WINDOW, outline=INK)
            tx1, ty1, tx2, ty2 = win.title_rect
            draw.rectangle((tx1, ty1, tx2 - 1, ty2 - 1), fill=TITLE_FRONT if win is scene.front else TITLE_BACK)
            _text(image, (tx1 + 4, ty1 + 2), win.title, (255, 255, 255))
            for w in win.widgets:
                _draw_widget(image, draw, w, w is focus)
        for win in scene.windows:
            for w in win.widgets:
                if w.kind == "dropdown" and w.open:
                    _draw_menu(image, draw, w)
        if scene.banner is not None:
            b = scene.banner
            x1, y1, x2, y2 = b.rect
            draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=(255, 214, 90), outline=INK)
            _text(image, (x1 + 6, y1 + 4), b.message, INK)
            cx1, cy1, cx2, cy2 = b.close_rect
            draw.rectangle((cx1, cy1, cx2 - 1, cy2 - 1), fill=(250, 240, 200), outline=INK)
            _text(image, (cx1 + 5, cy1 + 2), "x", INK)
        if scene.confirm is not None:
            c = scene.confirm
            x1, y1, x2, y2 = c.rect
            draw.rectangle((x1 + 3, y1 + 3, x2 + 2, y2 + 2), fill=(30, 30, 30))
            draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=WINDOW, outline=INK)
            draw.rectangle((x1, y1, x2 - 1, y1 + TITLE_H - 1), fill=TITLE_FRONT)
            _text(image, (x1 + 4, y1 + 2), "Confirm", (255, 255, 255))
            _text(image, (x1 + 5, y1 + TITLE_H + 4), c.message, INK)
            for label, (bx1, by1, bx2, by2) in (("OK", c.ok_rect), ("Cancel", c.cancel_rect)):
                draw.rectangle((bx1, by1, bx2 - 1, by2 - 1), fill=(214, 214, 220), outline=INK)
                _text(image, (bx1 + 5, by1 + 2), label, INK)
        if scene.popup is not None:
            p = scene.popup
            x1, y1, x2, y2 = p.rect
            draw.rectangle((x1 + 3, y1 + 3, x2 + 2, y2 + 2), fill=(30, 30, 30))
            draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=(255, 250, 225), outline=INK)
            _text(image, (x1 + 5, y1 + 4), p.title, INK)
            _text(image, (x1 + 5, y1 + 22), p.message, INK)
            cx1, cy1, cx2, cy2 = p.close_rect
            draw.rectangle((cx1, cy1, cx2 - 1, cy2 - 1), fill=(214, 214, 220), outline=INK)
            _text(image, (cx1 + 6, cy1 + 2), "Close", INK)
        self._frame = np.asarray(image)
        self._key = key
        return self._frame


def _occluded(scene: Scene, window_index: int, rect: Rect) -> bool:
    cx, cy = (rect[0] + rect[2]) // 2, (rect[1] + rect[3]) // 2
    for layer in (scene.popup, scene.confirm, scene.banner):
        if layer is not None and inside(layer.rect, (cx, cy)):
            return True
    return any(inside(w.rect, (cx, cy)) for w in scene.windows[window_index + 1:])


def a11y_tree(scene: Scene) -> str:
    lines = []
    if scene.popup is not None:
        p = scene.popup
        lines.append(f'dialog "{p.title}" [{",".join(map(str, p.rect))}] message="{p.message}"')
        lines.append(f'  button "Close" [{",".join(map(str, p.close_rect))}]')
    if scene.confirm is not None:
        c = scene.confirm
        lines.append(f'alertdialog "Confirm" [{",".join(map(str, c.rect))}] message="{c.message}"')
        lines.append(f'  button "OK" [{",".join(map(str, c.ok_rect))}]')
        lines.append(f'  button "Cancel" [{",".join(map(str, c.cancel_rect))}]')
    if scene.banner is not None:
        b = scene.banner
        lines.append(f'banner "Notification" [{",".join(map(str, b.rect))}] message="{b.message}"')
        lines.append(f'  button "Dismiss" [{",".join(map(str, b.close_rect))}]')
    for index in range(len(scene.windows) - 1, -1, -1):
        win = scene.windows[index]
        front = " front" if win is scene.front else ""
        lines.append(f'window "{win.title}" [{",".join(map(str, win.rect))}]{front}')
        for w in win.widgets:
            state = {"checkbox": f"checked={w.checked}", "field": f'text="{w.text}"',
                     "dropdown": f'value="{w.value or ""}" open={w.open}',
                     "list": (f'selected="{w.value or ""}" visible={[w.options[i] for i, _ in w.row_rects()]} '
                              f'items={list(w.options)}'),
                     "slider": f"value={w.value}", "button": "", "label": f'text="{w.text}"'}[w.kind]
            occluded = " occluded" if _occluded(scene, index, w.rect) else ""
            lines.append(f'  {w.kind} "{w.name}" [{",".join(map(str, w.rect))}] {state}{occluded}'.rstrip())
            if w.kind == "dropdown" and w.open:
                for option, rect in zip(w.options, w.option_rects()):
                    lines.append(f'    option "{option}" [{",".join(map(str, rect))}]')
    return "\n".join(lines)
