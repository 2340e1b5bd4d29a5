"""The trajectory inspector: markers on the pixels the engine acted on, escaped text, embedded screenshots,
injected-trajectory labels, the CLI over a TrajectoryStore, and (with Chromium) the rendered page."""
from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import chex
import numpy as np
import pytest
from PIL import Image

from desk_policies import DONE, SCREEN, WAIT, button_center
from envs.actions import parse_uitars, smart_resize
from guijax.inspector import (DRAG_END_COLOR, MARKER_COLOR, TITLE_COLOR, main, markers, page_html,
                              write_page)
from guijax.rollout.trajectory import Source, Status, Step, Trajectory


def shot(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200, (h, w, 3), dtype=np.uint8)  # never pure magenta/cyan


def circles(page: str, cls: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(rf'class="{cls}"[^>]*?cx="([\d.]+)" cy="([\d.]+)"', page)]


def test_markers_land_on_the_pixel_the_engine_acts_on():
    """UI-TARS-1.5 writes pixels of the smart-resized image (308x504 for a 300x500 screenshot), UI-TARS-1.0
    0-1000: both map to pixels of the stored screenshot, exactly as the engine maps them."""
    h, w = 300, 500
    assert smart_resize(h, w) == (308, 504)
    response = "Thought: the field.\nAction: click(start_box='(252,154)')"
    (m,), err = markers(response, (h, w))
    assert err is None and m.kind == "click"
    engine_point = parse_uitars(response, image_hw=(h, w), screen_hw=(h, w))[0].point
    assert m.point == engine_point == (round(252 / 504 * w), round(154 / 308 * h)) == (250, 150)
    (m10,), _ = markers("Action: click(start_box='(500,500)')", (h, w), "uitars-1.0")
    assert m10.point == (250, 150)
    traj = Trajectory("t", "i", [Step.text(shot(h, w), response)], 1.0, Status.DONE)
    for scale in (1.0, 2.0):  # the SVG's units are screenshot pixels whatever the displayed size
        page = page_html([traj], scale=scale)
        assert circles(page, "target") == [(250.5, 150.5)]
        assert f'viewBox="0 0 {w} {h}"' in page and f"width:{w * scale:g}px;height:{h * scale:g}px" in page


def test_page_escapes_text_and_embeds_the_screenshots():
    image = shot(40, 60, 1)
    evil = "<script>alert('x')</script> & \"q\""
    traj = Trajectory("task<1>", evil, [Step.text(image, f"Thought: {evil}\nAction: type(content='<b>hi</b>')")],
                      0.0, Status.STEP_LIMIT, error="<err>", meta={"note": "<m>"})
    page = page_html([traj], title="<title>")
    assert "<script" not in page and "<b>hi" not in page and "<err>" not in page and "<m>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;q&quot;" in page
    assert "task&lt;1&gt;" in page and "&lt;b&gt;hi&lt;/b&gt;" in page
    # self-contained: the only image is the data URL, nothing is fetched
    assert not re.search(r"(src|href)=\"(?!data:)|<link|<script|url\(http|@import", page)
    (url,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    chex.assert_trees_all_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(url))).convert("RGB")), image)


def test_drags_parse_errors_and_injected_trajectories():
    h, w = 280, 280
    drag = "Thought: move it.\nAction: drag(start_box='(10,20)', end_box='(200,100)')"
    expert = Trajectory("t1", "move", [Step.text(shot(h, w), drag), Step.text(shot(h, w, 2), "garbage"),
                                       Step.text(shot(h, w, 3), DONE)], 1.0, Status.DONE, source=Source.EXPERT,
                        meta={"handoff": 1, "domain": "desk"})
    expert.steps[1].error = "no 'Action:' in the response"
    page = page_html([("replay buffer", expert)])
    assert re.search(r'class="drag" x1="10.5" y1="20.5" x2="200.5" y2="100.5"', page)
    assert circles(page, "drag-end") == [(200.5, 100.5)] and circles(page, "target") == [(10.5, 20.5)]
    assert page.count('class="target"') == 1  # the unparsable step and finished() point nowhere
    assert "unparsable: no &#x27;Action:&#x27; in the response" in page
    assert "<td><b>source</b></td><td>expert</td>" in page and "<td><b>from</b></td><td>replay buffer</td>" in page
    assert "&quot;handoff&quot;: 1" in page and page.count("(after the handoff)") == 2
    assert page.count('class="step handoff"') == 2  # steps 2 and 3, taken after the handoff at step 1
    assert "1.000 (episode reward" in page and page.count("0 (the verifier scores the end)") == 2


def _store(tmp_path, trajectories):
    from guijax.data.store import TrajectoryStore

    TrajectoryStore(tmp_path / "store").append(trajectories)
    return tmp_path / "store"


def test_cli_writes_the_page_from_a_store(tmp_path, capsys):
    trajs = [Trajectory(f"task-{i % 2}", f"instruction {i}", [Step.text(shot(20, 30, i), WAIT)], 0.0,
                        Status.STEP_LIMIT) for i in range(3)]
    store = _store(tmp_path, trajs)
    out = tmp_path / "page.html"
    assert main(["--store", str(store), "--out", str(out)]) == 0
    assert out.read_text().count('class="episode"') == 3 and "3 episode(s), 0 solved" in out.read_text()
    assert main(["--store", str(store), "--out", str(out), "--task", "task-1"]) == 0
    assert re.findall(r"instruction \d", out.read_text()) == ["instruction 1"]
    assert main(["--store", str(store), "--out", str(out), "--limit", "2"]) == 0
    assert re.findall(r"instruction \d", out.read_text()) == ["instruction 0", "instruction 1"]
    capsys.readouterr()
    assert main(["--store", str(store), "--out", str(out), "--task", "nope"]) == 2
    assert f"{store} holds no trajectory of task 'nope'" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert f"{tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    assert main(["--store", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert f"{tmp_path / 'empty'} holds no trajectories" in capsys.readouterr().err


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])


def _find(page: np.ndarray, image: np.ndarray) -> list[tuple[int, int]]:
    """Top-left corners where `image` is drawn 1:1 in the rendered `page`: places where all but the overlaid
    marker pixels (under 5%) match, the best of each cluster (a shift by a pixel still matches flat areas)."""
    h, w = image.shape[:2]
    page = page[:, :, :3].astype(int)
    ph, pw = page.shape[0] - h + 1, page.shape[1] - w + 1
    samples = [(int(y), int(x)) for y, x in np.random.default_rng(0).integers(0, (h, w), (24, 2))]
    packed = (page[..., 0] << 16) | (page[..., 1] << 8) | page[..., 2]  # one int per pixel: fast exact compares
    votes = sum((packed[y:y + ph, x:x + pw] == (int(image[y, x, 0]) << 16 | int(image[y, x, 1]) << 8
                                                 | int(image[y, x, 2]))).astype(np.int8) for y, x in samples)
    scored = []
    for y, x in zip(*np.nonzero(votes >= len(samples) - 3)):  # a few samples may lie under a marker
        match = (np.abs(page[y:y + h, x:x + w] - image).max(-1) <= 2).mean()
        if match > 0.95:
            scored.append((match, int(y), int(x)))
    best: list[tuple[float, int, int]] = []
    for match, y, x in sorted(scored, reverse=True):
        if all(abs(y - by) > h // 2 or abs(x - bx) > w // 2 for _, by, bx in best):
            best.append((match, y, x))
    return [(y, x) for _, y, x in best]


@pytest.mark.desktop
def test_chromium_draws_the_markers_on_the_target_pixels(tmp_path):
    """Two desk episodes, a click on one task's button and a drag on another's desk, rendered by headless
    Chromium: the title bar is drawn, each screenshot appears 1:1, and the marker colours sit on the clicked
    pixel and the drag's end pixel (found from where the screenshot landed on the page)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not on PATH (installed by .ci/setup_desktop.sh)")
    from envs.desk import DeskEnv
    from envs.tasks import generate_desk_tasks

    tasks = [generate_desk_tasks(1, seed=5, families=[f], screen_hw=SCREEN)[0] for f in ("click_button", "pick_from_list")]
    shots = [DeskEnv(SCREEN, popups=False).reset(t).screenshot for t in tasks]
    assert (shots[0] != shots[1]).any(-1).mean() > 0.1  # each screenshot is found on the page at its own place
    for s in shots:  # the marker colours are nowhere on the desk itself
        for color in (MARKER_COLOR, DRAG_END_COLOR):
            assert not (np.abs(s.astype(int) - _rgb(color)).max(-1) <= 40).any()
    x, y, name = button_center(tasks[0])
    start, end = (30, 40), (200, 150)
    episodes = [
        Trajectory(tasks[0].id, tasks[0].instruction, [Step.text(shots[0], f"Thought: press {name}.\nAction: "
                                                                           f"click(start_box='({x},{y})')")],
                   1.0, Status.DONE),
        Trajectory(tasks[1].id, tasks[1].instruction, [Step.text(shots[1], f"Action: drag(start_box='{start}', "
                                                                           f"end_box='{end}')"),
                                                       Step.text(shots[1], WAIT)], 0.0, Status.STEP_LIMIT,
                   source=Source.REPLAY)]
    page = write_page(episodes, tmp_path / "page.html", title="chromium check")
    png = tmp_path / "page.png"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
           "--window-size=1000,1500", f"--screenshot={png}", page.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert png.exists(), f"chromium wrote no screenshot (rc {done.returncode}): {done.stderr[-2000:]}"
    rendered = np.asarray(Image.open(png).convert("RGB"))
    chex.assert_trees_all_equal(rendered[5, 5], _rgb(TITLE_COLOR))  # the page loaded, styles applied
    (top0,) = _find(rendered, shots[0])
    top1, top1_again = sorted(_find(rendered, shots[1]))  # the drag step's screenshot comes first
    for (ty, tx), (px, py), color in ((top0, (x, y), MARKER_COLOR), (top1, start, MARKER_COLOR),
                                      (top1, end, DRAG_END_COLOR)):
        assert np.abs(rendered[ty + py, tx + px].astype(int) - _rgb(color)).max() <= 8, \
            f"expected {color} at screenshot pixel {(px, py)}, page pixel {(tx + px, ty + py)}"
    # the WAIT step's copy of the same screenshot carries no marker
    ty, tx = top1_again
    assert np.abs(rendered[ty + start[1], tx + start[0]].astype(int) - shots[1][start[1], start[0]]).max() <= 2


def test_a_capped_page_covers_every_task_before_repeating_one():
    from guijax.inspector import spread
    from guijax.rollout.trajectory import Trajectory

    episodes = [(split, Trajectory(task, "", [])) for split, task in
                [("train", "a"), ("train", "a"), ("train", "a"), ("train", "b"), ("held_out", "c"), ("held_out", "c")]]
    picked = [(s, t.task_id) for s, t in spread(episodes, 4)]
    assert picked == [("train", "a"), ("train", "b"), ("held_out", "c"), ("train", "a")]
    assert len(spread(episodes, 100)) == 6 and spread(episodes, 0) == []
