"""Commands and directory listings honour their bounds: a child left running in another session does not hold
the reply, a timeout must be a positive number, and symlink loops do not recurse forever. No desktop needed."""
from __future__ import annotations

import os
import signal
import time
import types

import pytest

from envs.desktop.controller import directory_tree, run_command
from envs.server import Reply, _timeout

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


def test_a_child_left_in_another_session_does_not_hold_the_reply():
    start = time.monotonic()
    r = run_command("setsid sleep 30 & echo $!", shell=True, env=dict(os.environ), cwd=None, timeout_s=20)
    elapsed = time.monotonic() - start
    pid = int(r["output"].split()[0])
    try:
        assert r["returncode"] == 0 and not r.get("timed_out")
        assert elapsed < 5, f"the reply waited {elapsed:.1f}s for a detached child"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_output_and_stdin_still_travel():
    r = run_command(["/bin/bash", "-s"], shell=False, env=dict(os.environ), cwd=None, timeout_s=10,
                    stdin_data="echo out; echo err >&2; printf '\\xff'; exit 3")
    assert (r["output"], r["error"], r["returncode"]) == ("out\n\ufffd", "err\n", 3)  # undecodable bytes replaced
    slow = run_command("sleep 5", shell=True, env=dict(os.environ), cwd=None, timeout_s=0.3)
    assert slow["timed_out"] and "timed out after 0.3s" in slow["error"]


@pytest.mark.parametrize("requested", ["nan", float("nan"), "inf", -1, 0, True, "soon", [1]])
def test_a_timeout_that_is_not_a_positive_number_is_refused(requested):
    h = types.SimpleNamespace(server=types.SimpleNamespace(timeout_s=90.0))
    with pytest.raises(Reply) as err:
        _timeout(h, requested)
    assert err.value.status == 400


def test_a_timeout_is_capped_by_the_servers():
    h = types.SimpleNamespace(server=types.SimpleNamespace(timeout_s=90.0))
    assert (_timeout(h), _timeout(h, "5"), _timeout(h, 1e9)) == (90.0, 5.0, 90.0)


def test_symlink_loops_are_listed_once(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f.txt").write_text("x")
    (tmp_path / "a" / "b" / "up").symlink_to(tmp_path / "a")  # a loop back to an ancestor
    (tmp_path / "a" / "self").symlink_to(tmp_path / "a")
    tree = directory_tree(str(tmp_path / "a"))
    b = next(c for c in tree["children"] if c["name"] == "b")
    assert {c["name"] for c in b["children"]} == {"f.txt", "up"}
    assert next(c for c in b["children"] if c["name"] == "up")["children"] == []
    assert next(c for c in tree["children"] if c["name"] == "self")["children"] == []


def test_a_huge_tree_is_an_error_not_a_hang(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}").write_text("")
    assert "more than 10 entries" in directory_tree(str(tmp_path), max_entries=10)["error"]


def test_paths_expand_variables_from_the_desktops_environment(monkeypatch):
    """$HOME in a task's path is the desktop's private HOME, not the server's."""
    from envs.desktop.controller import LocalController, expand_vars

    monkeypatch.setenv("HOME", "/server/home")
    assert expand_vars("$HOME/a ${USER}/b $NOPE ${}", {"HOME": "/desk", "USER": "u"}) == "/desk/a u/b $NOPE ${}"
    ctl = object.__new__(LocalController)  # only the path logic: no display
    ctl.home, ctl.env = "/desk", {"HOME": "/desk", "DOCS": "/desk/Documents"}
    assert ctl._path("$HOME/x.txt") == "/desk/x.txt"
    assert ctl._path("${DOCS}/y.txt") == "/desk/Documents/y.txt"
    assert ctl._path("z.txt") == "/desk/z.txt"
