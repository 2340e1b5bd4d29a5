"""The local Xvfb desktop: free displays, X11 screenshots, commands with deadlines, cleanup on exit and crash."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from envs.desktop.checks import desktop_missing

pytestmark = [pytest.mark.desktop,
              pytest.mark.skipif(desktop_missing() is not None, reason=str(desktop_missing()))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def desktop():
    from envs.desktop.controller import LocalController
    from envs.desktop.display import Display

    d = Display((640, 480))
    c = LocalController(d, command_timeout_s=20)
    yield d, c
    c.close()
    d.close()


def test_two_displays_get_different_numbers_and_close_cleanly():
    from envs.desktop.display import Display

    a, b = Display((320, 240), window_manager=None), Display((320, 240), window_manager=None)
    try:
        assert a.number != b.number
        assert os.path.exists(f"/tmp/.X11-unix/X{a.number}") and os.path.exists(f"/tmp/.X11-unix/X{b.number}")
        pids = [a.xvfb.pid, b.xvfb.pid]
    finally:
        a.close()
        b.close()
    assert _wait_dead(pids) == []
    assert not os.path.exists(a._tmp)


def test_screenshot_is_rgb_of_screen_size_and_sees_windows(desktop):
    d, c = desktop
    shot = c.screenshot()
    assert shot.shape == (480, 640, 3) and shot.dtype == np.uint8
    assert c.screen_size() == (640, 480)
    c.launch(["xterm", "-title", "probe-window", "-bg", "white", "-geometry", "40x10+0+0"])
    from envs.desktop import windows

    assert windows.wait_window(c.env, ["probe-window"], 10) is not None
    time.sleep(0.3)
    after = c.screenshot()
    assert (after[:100, :100] == 255).all(axis=-1).mean() > 0.5  # the white xterm is drawn top-left
    assert c.close_window("probe-window")


def test_pyautogui_moves_the_pointer_on_this_display(desktop):
    _, c = desktop
    r = c.execute_python("pyautogui.moveTo(123, 77)")
    assert r["returncode"] == 0, r
    assert c.cursor_position() == (123, 77)


def test_command_timeout_kills_the_process_group(desktop, tmp_path):
    _, c = desktop
    marker = tmp_path / "child.pid"
    t = time.monotonic()
    r = c.execute(f"sleep 60 & echo $! > {marker}; wait", shell=True, timeout_s=1)
    assert time.monotonic() - t < 5
    assert r["status"] == "error" and r.get("timed_out") and "timed out after 1s" in r["error"]
    assert _wait_dead([int(marker.read_text())]) == []


def test_execute_shapes_and_home_expansion(desktop):
    d, c = desktop
    r = c.execute(["bash", "-c", "echo out; echo err >&2; exit 3"])
    assert (r["status"], r["output"], r["error"], r["returncode"]) == ("error", "out\n", "err\n", 3)
    c.upload("~/sub/x.txt", b"abc")
    assert (d.home / "sub" / "x.txt").read_bytes() == b"abc"
    assert c.execute(["cat", "~/sub/x.txt"])["output"] == "abc"
    assert c.get_file("~/sub/nope.txt") is None
    tree = c.list_directory("~/sub")
    assert tree == {"type": "directory", "name": "sub", "children": [{"type": "file", "name": "x.txt"}]}


def test_reset_kills_launched_apps_but_keeps_the_display(desktop):
    d, c = desktop
    c.launch(["sleep", "300"])
    pids = [p for p in d.reaper.pids() if p not in d.base_pids]
    assert pids
    c.reset()
    assert _wait_dead(pids) == []
    assert d.alive() and c.screenshot().shape == (480, 640, 3)


def test_crash_of_the_owner_kills_xvfb_and_apps(tmp_path):
    """SIGKILL the process that owns a desktop: the watchdog must take Xvfb, the WM and launched apps down."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from envs.desktop.display import Display
        from envs.desktop.controller import LocalController
        d = Display((320, 240))
        c = LocalController(d)
        c.launch(["sleep", "300"])
        time.sleep(0.3)
        print(" ".join(str(p) for p in d.reaper.pids()), d._tmp, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    pids, tmp = [int(p) for p in line[:-1]], line[-1]
    assert len(pids) >= 3 and all(_alive(p) for p in pids)  # Xvfb, openbox, sleep
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_dead(pids) == []
    deadline = time.monotonic() + 10
    while os.path.exists(tmp) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(tmp)


def test_sigterm_of_the_owner_cleans_up():
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from envs.desktop.display import Display
        d = Display((320, 240), window_manager=None)
        print(d.xvfb.pid, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) != 0
    assert _wait_dead([pid]) == []


def test_env_pool_holds_desktop_envs_and_leaves_no_processes():
    from envs.api import Task
    from envs.desktop.env import DesktopFactory
    from envs.pool import EnvPool

    task = Task.from_dict({"id": "pool-file", "instruction": "write a file",
                           "config": [{"type": "execute", "parameters": {"command": "echo -n 1 > ~/f", "shell": True}}],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "cat ~/f; echo",
                                                                            "shell": True},
                                         "expected": {"type": "rule", "rules": {"expected": "12\n"}}}})
    before = set(_xvfb_pids())
    pool = EnvPool(DesktopFactory(screen_size=(320, 240)), 1, timeout_s=60)
    try:
        r = pool.reset([task])[0]
        assert r.ok, r.error
        assert r.value.screenshot.shape == (240, 320, 3)
        assert pool.evaluate([0])[0].value == 0.0
        r = pool.step({0: "import subprocess, os; open(os.path.expanduser('~/f'), 'a').write('2')"})[0]
        assert r.ok, r.error
        assert pool.evaluate([0])[0].value == 1.0
        started = set(_xvfb_pids()) - before
        ours = [p for p in started if _descends_from(p, pool.worker_pids())]  # another test process may run one too
        assert len(ours) == 1
    finally:
        pool.close()
    assert _wait_dead(ours) == []


def _descends_from(pid: int, ancestors) -> bool:
    ancestors = set(ancestors)
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _xvfb_pids():
    out = subprocess.run(["ps", "-eo", "pid,comm"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:] if line.split()[1:] == ["Xvfb"]]


def test_attach_to_an_existing_display_leaves_it_running():
    from envs.desktop.controller import LocalController
    from envs.desktop.display import Display

    owner = Display((320, 240), window_manager=None)
    try:
        guest = Display.attach(owner.name, home=str(owner.home))
        c = LocalController(guest)
        assert (guest.width, guest.height) == (320, 240)
        assert c.execute_python("pyautogui.moveTo(5, 6)")["returncode"] == 0
        assert c.cursor_position() == (5, 6)
        c.launch(["sleep", "300"])
        app = [p for p in guest.reaper.pids()]
        c.close()
        guest.close()
        assert _wait_dead(app) == [] and owner.alive()
    finally:
        owner.close()
