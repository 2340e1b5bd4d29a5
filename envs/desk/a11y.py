"""Reading the desk's accessibility tree back into nodes, and grounding element descriptions to boxes.

This is the expert's only view of the screen (like Agent S2's grounding on the a11y tree); BEPA's trace
conversion grounds the expert's element descriptions the same way.
"""
from __future__ import annotations

import dataclasses
import re

Box = tuple[int, int, int, int]
_LINE = re.compile(r'^(?P<indent>\s*)(?P<role>\w+) "(?P<name>[^"]*)" \[(?P<rect>[-\d,]+)\](?P<rest>.*)$')


@dataclasses.dataclass(frozen=True)
class Node:
    role: str
    name: str
    rect: Box
    window: str | None  # owning window title; "" for the pop-up, CONFIRM / BANNER for those layers
    attrs: str  # the rest of the line: state text, "front", "occluded"

    def attr(self, key: str) -> str | None:
        m = re.search(rf'{key}=("([^"]*)"|\[[^\]]*\]|\S+)', self.attrs)
        if not m:
            return None
        return m.group(2) if m.group(2) is not None else m.group(1)


CONFIRM = "#confirm"  # owner of the confirmation dialog's buttons (not a valid window title on the desk)
BANNER = "#banner"  # owner of the banner's dismiss button
_LAYERS = {"dialog": "", "alertdialog": CONFIRM, "banner": BANNER}


def parse_tree(text: str) -> list[Node]:
    nodes, window = [], None
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"unparsable accessibility line: {line!r}")
        rect = tuple(int(v) for v in m.group("rect").split(","))
        role, name = m.group("role"), m.group("name")
        if role == "window":
            window = name
        elif role in _LAYERS:
            window = _LAYERS[role]
        nodes.append(Node(role, name, rect, name if role == "window" else window, m.group("rest").strip()))
    return nodes


class GroundingError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def describe(role: str, name: str, window: str | None) -> str:
    """Canonical element description for a node (what the expert writes in its S2 actions)."""
    if window == "":
        return f'the "{name}" button of the pop-up'
    if window == CONFIRM:
        return f'the "{name}" button of the confirmation dialog'
    if window == BANNER:
        return f'the "{name}" button of the notification banner'
    if role == "option":
        return f'the "{name}" option of the open menu'
    return f'the "{name}" {role} in the "{window}" window'


def ground(text: str, description: str) -> Box:
    """Element description -> screen box, from the current a11y tree text."""
    nodes = parse_tree(text)
    m = re.fullmatch(r'the title bar of the "([^"]+)" window', description)
    if m:
        in_front: list[Box] = []  # the tree lists the pop-up and windows front to back
        for n in nodes:
            if n.role in _LAYERS or (n.role == "window" and n.name != m.group(1)):
                in_front.append(n.rect)
            elif n.role == "window":
                return _visible_part((n.rect[0], n.rect[1], n.rect[2], n.rect[1] + 16), in_front)
    m = re.fullmatch(r'the "([^"]+)" slider at (\d+)%', description)
    if m:
        for n in nodes:
            if n.role == "slider" and n.name == m.group(1):
                lo, hi = n.rect[0] + 4, n.rect[2] - 4
                x = lo + round((hi - lo) * int(m.group(2)) / 100)
                return (x, n.rect[1], x + 1, n.rect[3])
    m = re.fullmatch(r'the "([^"]+)" slider knob', description)
    if m:
        for n in nodes:
            if n.role == "slider" and n.name == m.group(1):
                lo, hi = n.rect[0] + 4, n.rect[2] - 4
                x = lo + round((hi - lo) * int(n.attr("value") or 0) / 100)
                return (x - 2, n.rect[1], x + 3, n.rect[3])
    m = re.fullmatch(r'the "([^"]+)" row of the "([^"]+)" list', description)
    if m:
        item, list_name = m.groups()
        for n in nodes:
            if n.role == "list" and n.name == list_name:
                visible = re.findall(r"'([^']*)'", n.attr("visible") or "")
                if item in visible:
                    row = visible.index(item)
                    return (n.rect[0], n.rect[1] + 16 * row, n.rect[2], n.rect[1] + 16 * (row + 1))
                raise GroundingError(f"row {item!r} of list {list_name!r} is not visible")
    for n in nodes:
        if describe(n.role, n.name, n.window) == description:
            return n.rect
    raise GroundingError(f"cannot ground element description {description!r}")


def _visible_part(bar: Box, occluders: list[Box]) -> Box:
    """The widest horizontal stretch of a title bar not covered by windows in front of it."""
    spans = [(bar[0], bar[2])]
    for x1, y1, x2, y2 in occluders:
        if y1 >= bar[3] or y2 <= bar[1]:
            continue
        spans = [piece for lo, hi in spans for piece in ((lo, min(hi, x1)), (max(lo, x2), hi)) if piece[1] - piece[0] > 0]
    if not spans:
        raise GroundingError("the title bar is fully covered by other windows")
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return (lo, bar[1], hi, bar[3])
