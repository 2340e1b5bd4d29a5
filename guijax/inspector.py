"""Trajectory inspector: one static, self-contained HTML page per run or evaluation, to read what the agent saw
and did step by step (EvoCUA's visualization-driven diagnosis: coordinate drift, thoughts that disagree with
their actions, where a trajectory came from).

Every screenshot is embedded as a base64 PNG data URL and every action's target is drawn over it as inline
SVG, so the page needs no network, no scripts and no other file. The SVG's viewBox is the screenshot's own
pixel grid and it covers the image exactly, so a marker lands on the pixel the action targets at any display
size. That pixel is the one the engine acted on: the engine parses a response with the screenshot's size as
both the image and the screen size (guijax.rollout.engine.RolloutEngine.advance), so the parsed coordinates
are pixels of the stored screenshot, whatever space the model wrote them in (UI-TARS-1.5: the smart-resized
image; UI-TARS-1.0: 0-1000).

    python -m guijax.inspector --store RUN/eval_final_trajectories --out eval_final.html [--limit N] [--task ID]
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import json
import pathlib
import re
import sys
from typing import Iterable, Sequence

from envs.actions import Action, ActionParseError, ActionType
from envs.actions.grammar import GRAMMARS, parse_response, reasoning
from envs.atomic import write_text_atomic
from guijax.chat import png_data_url
from guijax.rollout.trajectory import Trajectory

TITLE_COLOR = "#1f4e79"  # the page's title bar
MARKER_COLOR = "#ff00ff"  # a pointed action's target (click, drag start, scroll, hover)
DRAG_END_COLOR = "#00e5ff"  # a drag's end point
_POINTED = {ActionType.CLICK: "click", ActionType.LEFT_DOUBLE: "double click", ActionType.LEFT_TRIPLE: "triple click",
            ActionType.RIGHT_SINGLE: "right click", ActionType.MIDDLE_SINGLE: "middle click",
            ActionType.HOVER: "hover", ActionType.LONG_PRESS: "long press", ActionType.SCROLL: "scroll",
            ActionType.DRAG: "drag"}

_CSS = f"""
body {{ margin: 0; font: 14px/1.4 sans-serif; background: #f4f4f4; color: #222; }}
.title {{ height: 48px; line-height: 48px; padding: 0 16px; margin: 0; background: {TITLE_COLOR}; color: #fff;
         font-size: 18px; overflow: hidden; white-space: nowrap; }}
.episode {{ margin: 16px; padding: 12px; background: #fff; border: 1px solid #ccc; }}
.episode h2 {{ margin: 0 0 8px; font-size: 16px; }}
.ok {{ color: #1a7f37; }} .bad {{ color: #b3261e; }}
table.meta td {{ padding: 1px 8px 1px 0; vertical-align: top; }}
.step {{ display: flex; gap: 16px; margin-top: 12px; border-top: 1px solid #eee; padding-top: 12px; }}
.shot {{ position: relative; flex: none; line-height: 0; }}
.shot img {{ display: block; width: 100%; height: 100%; image-rendering: pixelated; }}
.shot svg {{ position: absolute; left: 0; top: 0; width: 100%; height: 100%; }}
.text pre {{ white-space: pre-wrap; margin: 2px 0 6px; background: #f6f8fa; padding: 4px; }}
.handoff {{ background: #fff8e1; }}
"""


@dataclasses.dataclass(frozen=True)
class Marker:
    """One action's target in screenshot pixels: a point, or a drag from `point` to `end`."""

    kind: str
    point: tuple[int, int]
    end: tuple[int, int] | None = None


def action_text(response: str) -> str:
    """The response from its first line-opening 'Action:' on (the whole response when there is none)."""
    m = re.search(r"(?:^|\n)[ \t]*(Action:.*)", response, re.DOTALL)
    return m.group(1).strip() if m else response.strip()


def markers(response: str, screenshot_hw: tuple[int, int], coordinate_model: str = "uitars-1.5",
            grammar: str = "uitars") -> tuple[list[Marker], str | None]:
    """The pointed actions of a response in pixels of the screenshot it answered, parsed as the engine parses
    them; (markers, None), or ([], the parse error) for a response the engine could not execute."""
    try:
        actions: Sequence[Action] = parse_response(response, grammar=grammar, screen_hw=screenshot_hw,
                                                   coordinate_model=coordinate_model)
    except (ActionParseError, ValueError) as err:
        return [], str(err)
    return [Marker(_POINTED[a.kind], tuple(a.point), tuple(a.end_point) if a.kind == ActionType.DRAG else None)
            for a in actions if a.kind in _POINTED and a.point is not None], None


def _svg(marks: Sequence[Marker], w: int, h: int) -> str:
    """An SVG over the screenshot, its user units the screenshot's pixels; pixel (x, y) spans [x, x+1), so
    shapes are centred at (x + 0.5, y + 0.5)."""
    r = max(4.0, min(w, h) / 40)
    parts = [f'<svg viewBox="0 0 {w} {h}" preserveAspectRatio="none">',
             f'<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
             f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{MARKER_COLOR}"/></marker></defs>']
    for m in marks:
        x, y = m.point[0] + 0.5, m.point[1] + 0.5
        if m.end is not None:
            ex, ey = m.end[0] + 0.5, m.end[1] + 0.5
            parts.append(f'<line class="drag" x1="{x}" y1="{y}" x2="{ex}" y2="{ey}" stroke="{MARKER_COLOR}" '
                         f'stroke-width="{r / 2}" marker-end="url(#arrow)"/>')
            parts.append(f'<circle class="drag-end" cx="{ex}" cy="{ey}" r="{r / 2}" fill="{DRAG_END_COLOR}"/>')
        parts.append(f'<circle class="target-ring" cx="{x}" cy="{y}" r="{r * 2}" fill="none" stroke="{MARKER_COLOR}" '
                     f'stroke-width="{r / 3}"/>')
        parts.append(f'<circle class="target" data-kind="{html.escape(m.kind)}" cx="{x}" cy="{y}" r="{r / 2}" '
                     f'fill="{MARKER_COLOR}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _meta_text(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, default=str)


def episode_html(traj: Trajectory, index: int, *, label: str = "", coordinate_model: str = "uitars-1.5",
                 grammar: str = "uitars", scale: float = 1.0, max_side: int | None = None) -> str:
    """One episode: its header (task, instruction, outcome, where it came from) and every step."""
    e = html.escape
    ok = traj.success
    handoff = int(traj.meta.get("handoff", 0) or 0)
    rows = [("task", traj.task_id), ("instruction", traj.instruction), ("reward", f"{traj.reward:.3f}"),
            ("success", "yes" if ok else "no"), ("status", traj.status.value), ("source", traj.source.value)]
    if label:
        rows.insert(0, ("from", label))
    if traj.plan:
        rows.append(("plan", " / ".join(traj.plan)))
    if traj.error:
        rows.append(("error", traj.error))
    if traj.meta:
        rows.append(("meta", _meta_text(traj.meta)))
    out = [f'<section class="episode" id="episode-{index}">',
           f'<h2>#{index} {e(traj.task_id)} <span class="{"ok" if ok else "bad"}">'
           f'{"success" if ok else "failure"}</span></h2>',
           '<table class="meta">' + "".join(f"<tr><td><b>{e(k)}</b></td><td>{e(str(v))}</td></tr>" for k, v in rows)
           + "</table>"]
    for i, step in enumerate(traj.steps):
        h, w = step.screenshot.shape[:2]
        marks, parse_error = markers(step.response, (h, w), coordinate_model, grammar)
        thought = reasoning(step.response, grammar)
        last = i == len(traj.steps) - 1
        reward = f"{traj.reward:.3f} (episode reward, scored at its end)" if last else "0 (the verifier scores the end)"
        cls = "step handoff" if handoff and i >= handoff else "step"
        out.append(
            f'<div class="{cls}" id="episode-{index}-step-{i + 1}">'
            f'<div class="shot" style="width:{w * scale:g}px;height:{h * scale:g}px">'
            f'<img alt="screenshot before step {i + 1}" width="{w}" height="{h}" '
            f'src="{png_data_url(step.screenshot, max_side)}">{_svg(marks, w, h)}</div>'
            f'<div class="text"><b>step {i + 1}</b>' + (" (after the handoff)" if handoff and i >= handoff else "")
            + f'<div>thought</div><pre class="thought">{e(thought)}</pre>'
            f'<div>action</div><pre class="action">{e(action_text(step.response))}</pre>'
            + "".join(f'<div class="marker">{e(m.kind)} at ({m.point[0]}, {m.point[1]})'
                      + (f" → ({m.end[0]}, {m.end[1]})" if m.end else "") + "</div>" for m in marks)
            + (f'<div class="bad">unparsable: {e(step.error or parse_error)}</div>'
               if step.error or parse_error else "")
            + f"<div>reward: {e(reward)}</div></div></div>")
    out.append("</section>")
    return "".join(out)


def page_html(episodes: Iterable[Trajectory | tuple[str, Trajectory]], title: str = "trajectories", *,
              coordinate_model: str = "uitars-1.5", grammar: str = "uitars", scale: float = 1.0,
              max_side: int | None = None) -> str:
    """The whole page; `episodes` are trajectories or (label, trajectory) pairs, the label saying where each
    came from (a split, a shard). `scale` sets the displayed size of screenshots (CSS pixels per screenshot
    pixel), `max_side` caps the embedded images' size (large desktops make large pages)."""
    body = []
    n = solved = 0
    for item in episodes:
        label, traj = item if isinstance(item, tuple) else ("", item)
        body.append(episode_html(traj, n, label=label, coordinate_model=coordinate_model, grammar=grammar,
                                 scale=scale, max_side=max_side))
        n += 1
        solved += traj.success
    summary = f"{n} episode(s), {solved} solved"
    return ("<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f'<h1 class="title">{html.escape(title)} · {summary}</h1>' + "".join(body) + "</body></html>")


def spread(episodes: Sequence[tuple[str, Trajectory]], limit: int) -> list[tuple[str, Trajectory]]:
    """At most `limit` of (label, trajectory) pairs, covering tasks evenly: every task's first episode, then
    every task's second, and so on, in their original order within each pass."""
    rank: dict[str, int] = {}
    keyed = []
    for i, (label, traj) in enumerate(episodes):
        key = f"{label}/{traj.task_id}"
        keyed.append((rank.get(key, 0), i))
        rank[key] = rank.get(key, 0) + 1
    return [episodes[i] for _, i in sorted(keyed)[:limit]]


def write_page(episodes: Iterable[Trajectory | tuple[str, Trajectory]], path: str | pathlib.Path,
               title: str = "trajectories", **options) -> pathlib.Path:
    """Write `page_html(episodes, title, **options)` to `path` atomically."""
    return write_text_atomic(pathlib.Path(path), page_html(episodes, title, **options))


def store_episodes(directory: str | pathlib.Path, limit: int | None = None,
                   task: str | None = None) -> list[Trajectory]:
    """The trajectories of a TrajectoryStore folder in store order, optionally one task's only and at most
    `limit` (others are skipped without decoding their screenshots). A missing folder, or one with no
    (matching) trajectory, is an error naming the folder."""
    from guijax.data.store import SUFFIX, TrajectoryStore

    directory = pathlib.Path(directory)
    if not directory.is_dir():  # TrajectoryStore would create it
        raise FileNotFoundError(f"trajectory store folder {directory} does not exist")
    store = TrajectoryStore(directory)
    if not len(store):
        raise ValueError(f"trajectory store folder {directory} holds no trajectories (no *{SUFFIX} shard with "
                         "records)")
    picked = [i for i, (task_id, _) in enumerate(store.summaries()) if task is None or task_id == task]
    if not picked:
        raise ValueError(f"trajectory store folder {directory} holds no trajectory of task {task!r}")
    return [store[i] for i in picked[:limit]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m guijax.inspector", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="a TrajectoryStore folder")
    parser.add_argument("--out", required=True, help="the HTML page to write")
    parser.add_argument("--limit", type=int, default=None, help="at most this many episodes")
    parser.add_argument("--task", default=None, help="only this task id's episodes")
    parser.add_argument("--coordinate-model", default="uitars-1.5", choices=("uitars-1.5", "uitars-1.0"),
                        help="UI-TARS responses: the coordinate space they were written in")
    parser.add_argument("--grammar", default="uitars", choices=GRAMMARS,
                        help="the action grammar of the responses (the one rollout.prompt asked for)")
    parser.add_argument("--scale", type=float, default=1.0, help="displayed CSS pixels per screenshot pixel")
    parser.add_argument("--max-side", type=int, default=None, help="downscale embedded screenshots to this size")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    try:
        episodes = store_episodes(args.store, args.limit, args.task)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = write_page(episodes, args.out, title=pathlib.Path(args.store).name,
                      coordinate_model=args.coordinate_model, grammar=args.grammar, scale=args.scale,
                      max_side=args.max_side)
    print(f"wrote {path} ({len(episodes)} episode(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
