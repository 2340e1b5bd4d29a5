"""OSWorld task support without a desktop: loading all 369 tasks, setup semantics, getters, metrics,
evaluation semantics and the coverage report (a fake controller stands in for the desktop)."""
import json
import os
import pathlib

import numpy as np
import pytest

from envs.actions.model import Action, ActionType
from envs.api import Task, TaskError
from envs.desktop.controller import ControllerError
from envs.metrics import get_metric
from envs.osworld.env import EvaluationError, OSWorldEnv
from envs.osworld.loader import Step, load_osworld, load_split, parse_task
from envs.osworld.setup import SetupContext, SetupError, UnsupportedStep, run_steps

REPO = pathlib.Path(__file__).resolve().parents[2]
OSWORLD = pathlib.Path(os.environ.get("GUIJAX_OSWORLD_DIR", REPO.parent / "shared" / "osworld"))
if not OSWORLD.exists():
    OSWORLD = pathlib.Path("/work/shared/osworld")
needs_osworld = pytest.mark.skipif(not (OSWORLD / "examples").is_dir(), reason=f"OSWorld task files not at {OSWORLD}")


# -- loader ---------------------------------------------------------------------------------------------------
@needs_osworld
def test_all_369_osworld_tasks_load_into_typed_tasks():
    tasks = load_osworld(OSWORLD)
    assert len(tasks) == 369
    domains = {t.domain for t in tasks}
    assert domains == {"chrome", "gimp", "libreoffice_calc", "libreoffice_impress", "libreoffice_writer",
                       "multi_apps", "os", "thunderbird", "vlc", "vs_code"}
    for t in tasks:
        ev = t.evaluator
        assert ev.funcs and ev.conj in ("and", "or")
        assert len(ev.options) == len(ev.funcs)
        if not ev.infeasible:
            assert len(ev.results) == len(ev.funcs)
    by_id = {t.id: t for t in tasks}
    t = by_id["b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa"]
    assert t.evaluator.infeasible and t.setup == () and t.domain == "os"
    assert sum(t.evaluator.infeasible for t in tasks) == 30
    assert sum(len(t.setup) for t in tasks) == sum(len(json.load(open(t.task.source)).get("config", [])) for t in tasks)


@needs_osworld
def test_split_file_names_existing_tasks():
    tasks = load_split(OSWORLD / "test_all.json", OSWORLD)
    assert len(tasks) == 369 and len({t.id for t in tasks}) == 369


@pytest.mark.hostile
def test_malformed_task_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "os" / "x.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"id": "x", "instruction": "i", "config": [{"parameters": {}}], "evaluator": {"func": "exact_match"}}))
    with pytest.raises(TaskError, match=r"x\.json.*config"):
        load_osworld(tmp_path)
    bad.write_text(json.dumps({"id": "x", "instruction": "i", "evaluator": {"func": ["a", "b"], "result": [{"type": "rule", "rules": {}}]}}))
    with pytest.raises(TaskError, match=r"x\.json \(task x\): evaluator.result has 1 getters for 2 metrics"):
        load_osworld(tmp_path)
    bad.write_text(json.dumps({"id": "x", "instruction": "i", "evaluator": {"func": "m", "conj": "xor"}}))
    with pytest.raises(TaskError, match="conj"):
        load_osworld(tmp_path)


def test_unknown_types_are_reported_per_task_not_raised():
    from envs.osworld.coverage import task_needs

    t = parse_task(Task.from_dict({"id": "u", "instruction": "i", "config": [{"type": "teleport", "parameters": {}}],
                                   "evaluator": {"func": "mystery_metric", "result": {"type": "mind_reader"},
                                                 "postconfig": [{"type": "warp", "parameters": {}}]}}))
    needs = task_needs(t)
    assert {"setup step 'teleport'", "postconfig step 'warp'", "metric 'mystery_metric'", "getter 'mind_reader'"} <= set(needs)


# -- fake controller ------------------------------------------------------------------------------------------
class FakeController:
    screen_hw = (1080, 1920)

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.calls: list[tuple] = []
        self.execute_results: list = []
        self.open_errors: list = []
        self.terminal = None

    def execute(self, command, shell=False, timeout_s=None):
        self.calls.append(("execute", command, shell))
        if self.execute_results:
            r = self.execute_results.pop(0)
            if isinstance(r, Exception):
                raise r
            return r
        return {"status": "success", "output": "", "error": "", "returncode": 0}

    def execute_python(self, code):
        self.calls.append(("python", code))
        return {"status": "success", "output": "", "error": "", "returncode": 0}

    def launch(self, command, shell=False):
        self.calls.append(("launch", command))
        raise ControllerError("no such program", status=500)

    def open_file(self, path, window_name=None, timeout_s=None):
        self.calls.append(("open", path))
        if self.open_errors:
            raise self.open_errors.pop(0)

    def activate_window(self, name, strict=False, by_class=False):
        self.calls.append(("activate", name))
        return False

    close_window = activate_window

    def upload(self, path, data):
        self.files[path] = data

    def get_file(self, path):
        return self.files.get(path)

    def list_directory(self, path):
        return {"type": "directory", "name": "d", "children": [{"type": "file", "name": n} for n in sorted(self.files)]}

    def terminal_output(self):
        return self.terminal

    def screenshot(self):
        return np.zeros((1080, 1920, 3), np.uint8)

    def screen_size(self):
        return (1920, 1080)

    def reset(self):
        self.calls.append(("reset",))

    def close(self):
        pass


def _ctx(tmp_path, ctl=None, **kw):
    ctl = ctl or FakeController()
    return ctl, SetupContext(ctl, str(tmp_path), retry_scale=0.0, **kw)


def test_execute_placeholders_until_and_failure_limit(tmp_path):
    ctl, ctx = _ctx(tmp_path)
    run_steps([Step("execute", {"command": ["echo", "{SCREEN_WIDTH_HALF}x{SCREEN_HEIGHT}", "{CLIENT_PASSWORD}"]})], ctx)
    assert ctl.calls[-1] == ("execute", ["echo", "960x1080", "password"], False)
    ok = {"status": "success", "output": "ready\n", "error": "", "returncode": 0}
    ctl.execute_results = [{**ok, "output": "", "returncode": 1}, ControllerError("down", 503, True), ok]
    run_steps([Step("command", {"command": "probe", "shell": True, "until": {"stdout": "ready"}})], ctx)
    assert len(ctl.execute_results) == 0
    ctl.execute_results = [ControllerError("down", 500)] * 5 + [ok]
    with pytest.raises(SetupError, match=r"task t: setup step 1 \(execute\) failed: execute failed after 5 attempts"):
        run_steps([Step("execute", {"command": "x"})], ctx, task_id="t")


def test_open_retries_transient_and_fails_fast_otherwise(tmp_path):
    ctl, ctx = _ctx(tmp_path)
    ctl.open_errors = [ControllerError("busy", 503, transient=True)] * 2
    run_steps([Step("open", {"path": "~/a.txt"})], ctx)
    assert [c for c in ctl.calls if c[0] == "open"] == [("open", "~/a.txt")] * 3
    ctl.calls.clear()
    ctl.open_errors = [ControllerError("Application/file not found", 404)]
    with pytest.raises(SetupError, match="not found"):
        run_steps([Step("open", {"path": "~/b.txt"})], ctx)
    assert len([c for c in ctl.calls if c[0] == "open"]) == 1


def test_launch_and_window_failures_are_logged_not_raised(tmp_path, caplog):
    ctl, ctx = _ctx(tmp_path)
    run_steps([Step("launch", {"command": "google-chrome --x"}), Step("activate_window", {"window_name": "W"}),
               Step("close_window", {"window_name": "W"}), Step("sleep", {"seconds": 0})], ctx)
    assert ("launch", ["google-chrome", "--x"]) in ctl.calls
    assert "no window matches 'W'" in caplog.text


def test_download_from_osworld_cache_name_relative_path_file_url_and_miss(tmp_path):
    from envs.desktop.cache import osworld_cache_name

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    url = "https://huggingface.co/datasets/x/resolve/main/a/report.xlsx"
    (cache_dir / osworld_cache_name(url, "/home/user/report.xlsx")).write_bytes(b"cached")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "n.txt").write_bytes(b"relative")
    (tmp_path / "f.bin").write_bytes(b"fileurl")
    ctl, ctx = _ctx(cache_dir, base_dir=str(tmp_path))
    run_steps([Step("download", {"files": [{"url": url, "path": "/home/user/report.xlsx"},
                                           {"url": "assets/n.txt", "path": "~/n.txt"},
                                           {"url": (tmp_path / "f.bin").as_uri(), "path": "~/f.bin"}]})], ctx)
    assert ctl.files == {"/home/user/report.xlsx": b"cached", "~/n.txt": b"relative", "~/f.bin": b"fileurl"}
    with pytest.raises(SetupError, match="not in the local cache"):
        run_steps([Step("download", {"files": [{"url": "https://example.org/nope.zip", "path": "~/z"}]})], ctx)


def test_unsupported_step_is_a_clear_error(tmp_path):
    _, ctx = _ctx(tmp_path)
    with pytest.raises(UnsupportedStep, match="task q: setup step 1 has unsupported type 'googledrive'"):
        run_steps([Step("googledrive", {})], ctx, task_id="q")
    with pytest.raises(SetupError, match="bad parameters"):
        run_steps([Step("sleep", {"secs": 1})], ctx, task_id="q")


# -- metrics --------------------------------------------------------------------------------------------------
def test_simple_metrics():
    assert get_metric("exact_match")("yes\n", {"expected": "yes\n"}) == 1.0
    assert get_metric("exact_match")("no\n", {"expected": "yes\n"}) == 0.0
    inc = get_metric("check_include_exclude")
    assert inc("a b c", {"include": ["a", "c"], "exclude": ["z"]}) == 1.0
    assert inc("a b z", {"include": ["a"], "exclude": ["z"]}) == 0.0 and inc(None, {"include": []}) == 0.0
    js = get_metric("check_direct_json_object")
    assert js("{'name': 'g', 'debug': false}", {"expected": {"name": "g", "debug": False}}) == 1.0
    assert js('{"name": "g"}', {"expected": {"name": "g", "debug": False}}) == 0.0
    assert js("not json", {"expected": {}}) == 0.0
    assert js({"k": ["a", "b"]}, {"expected": {"k": ["x", "b"]}, "expect_in_result": True}) == 1.0
    assert js({"k": "hello world"}, {"expected": {"k": "world"}, "expect_in_result": True}) == 1.0
    assert get_metric("check_moved_jpgs")({"children": [{"name": "a"}, {"name": "b"}]}, {"expected": ["b", "a"]}) == 1.0
    assert get_metric("check_moved_jpgs")({"children": [{"name": "a"}]}, {"expected": ["b", "a"]}) == 0.0
    assert get_metric("literal_match")("Abc", "abc", ignore_case=True) == 1.0
    assert get_metric("is_in_list")(["x", "y"], {"expected": "y"}) == 1.0


def test_text_file_metrics(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_text("Hello  World\n")
    b.write_text("hello world")
    c.write_text("eggs\nbread\n")
    ctf = get_metric("compare_text_file")
    assert ctf(str(a), str(b)) == 0.0
    assert ctf(str(a), str(b), ignore_blanks=True, ignore_case=True) == 1.0
    assert ctf(None, str(b)) == 0.0 and ctf(str(tmp_path / "missing"), str(b)) == 0.0
    assert get_metric("file_contains")(str(c), {"expected": ["eggs", "bread"]}) == 1.0
    assert get_metric("check_list")(str(c), {"expect": ["^eggs$"], "unexpect": ["^milk$"]}) == 1.0
    assert get_metric("check_list")(str(c), {"expect": ["^milk$"]}) == 0.0
    assert get_metric("compare_csv")(str(c), str(c)) == 1.0


def test_compare_table(tmp_path):
    openpyxl = pytest.importorskip("openpyxl")

    def book(path, rows, title="Sheet1"):
        wb = openpyxl.Workbook()
        wb.active.title = title
        for r in rows:
            wb.active.append(r)
        wb.save(path)
        return str(path)

    a = book(tmp_path / "a.xlsx", [["x", 1.0], ["y", 2]])
    b = book(tmp_path / "b.xlsx", [["x", 1], ["y", 2]])
    c = book(tmp_path / "c.xlsx", [["x", 1], ["y", 3]])
    d = book(tmp_path / "d.xlsx", [["x", 1], ["y", 2]], title="Other")
    ct = get_metric("compare_table")
    assert ct(a, b) == 1.0 and ct(a, c) == 0.0 and ct(a, d) == 0.0 and ct(None, b) == 0.0
    rules = [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]
    assert ct(a, b, rules=rules) == 1.0 and ct(a, c, rules=rules) == 0.0
    assert ct(a, d, rules=[{"type": "sheet_data", "sheet_idx0": "RN" + "Sheet1", "sheet_idx1": "ENOther"}]) == 1.0
    cell = lambda coord, method, ref: [{"type": "check_cell", "sheet_idx": 0, "coordinate": coord,
                                        "props": {"value": {"method": method, "ref": ref}}}]
    assert ct(a, rules=cell("B2", "approx:0.01", 2.001)) == 1.0
    assert ct(a, rules=cell("A1", "str_eq", "x")) == 1.0 and ct(a, rules=cell("A1", "eq", "z")) == 0.0
    with pytest.raises(ValueError, match="rule type 'pivot_table' is not supported"):
        ct(a, b, rules=[{"type": "pivot_table"}])


# -- env evaluation semantics ---------------------------------------------------------------------------------
def _task(evaluator, config=()):
    return Task.from_dict({"id": "e", "instruction": "do", "config": list(config), "evaluator": evaluator})


def test_env_infeasible_fail_and_conj(tmp_path):
    ctl = FakeController()
    env = OSWorldEnv(ctl, cache_root=str(tmp_path), settle_s=0, wait_s=0)
    env.reset(_task({"func": "infeasible"}))
    assert env.evaluate() == 0.0
    res = env.step(Action(ActionType.FAIL))
    assert res.done and env.evaluate() == 1.0
    value = lambda v: {"type": "rule", "rules": v}  # the rule getter hands its `rules` to the metric
    want = {"type": "rule", "rules": {"expected": 1}}
    both = {"func": ["exact_match", "exact_match"], "result": [value(1), value(2)], "expected": [want, want]}
    env.reset(_task({**both, "conj": "and"}))
    assert env.evaluate() == 0.0
    env.reset(_task({**both, "conj": "or"}))
    assert env.evaluate() == 1.0
    env.step(Action(ActionType.FAIL))
    assert env.evaluate() == 0.0  # FAIL on a feasible task scores 0


def test_a_task_only_a_judge_decides_scores_0_on_a_desktop_too(tmp_path):
    env = OSWorldEnv(FakeController(), cache_root=str(tmp_path), settle_s=0, wait_s=0)
    env.reset(_task({"func": "judged"}))  # SEAgent's generated tasks carry no validator
    assert env.evaluate() == 0.0


def test_unknown_metric_at_evaluation_names_the_task(tmp_path):
    env = OSWorldEnv(FakeController(), cache_root=str(tmp_path), settle_s=0)
    env.reset(_task({"func": "compare_pptx_files", "result": {"type": "rule", "rules": 1}}))
    with pytest.raises(EvaluationError, match="task e: evaluation failed: .*unknown metric 'compare_pptx_files'"):
        env.evaluate()


def test_env_step_runs_pyautogui_and_control_words(tmp_path):
    ctl = FakeController()
    env = OSWorldEnv(ctl, cache_root=str(tmp_path), settle_s=0, wait_s=0, step_limit=3)
    obs = env.reset(_task({"func": "exact_match", "result": {"type": "vm_file", "path": "~/x", "dest": "x"},
                           "expected": {"type": "rule", "rules": {"expected": None}}}))
    assert obs.screenshot.shape == (1080, 1920, 3) and obs.instruction == "do"
    assert ctl.calls[0] == ("reset",)
    r = env.step(Action(ActionType.CLICK, point=(10, 20)))
    assert not r.done and "pyautogui.click(10, 20" in ctl.calls[-1][1]
    r = env.step("WAIT")
    assert not r.done
    r = env.step("pyautogui.press('a')")
    assert r.done and r.info["step_limit"]
    assert env.evaluate() == 1.0  # the vm_file getter gives None for a missing file


def test_env_postconfig_runs_before_scoring_and_missing_cache_file_scores_0(tmp_path):
    ctl = FakeController()
    ev = {"func": "compare_text_file", "result": {"type": "vm_file", "path": "~/o", "dest": "o"},
          "expected": {"type": "cache_file", "path": "absent.txt"},
          "postconfig": [{"type": "execute", "parameters": {"command": "sync", "shell": True}}]}
    (tmp_path / "ref.txt").write_text("ok")
    env = OSWorldEnv(ctl, cache_root=str(tmp_path / "c"), cache_dirs=[str(tmp_path)], settle_s=0)
    env.reset(_task({**ev, "expected": {"type": "cache_file", "path": "ref.txt"}}))
    assert env.evaluate() == 0.0  # no result file yet
    assert ("execute", "sync", True) in ctl.calls
    ctl.files["~/o"] = b"ok"
    assert env.evaluate() == 1.0
    env.reset(_task(ev))
    with pytest.raises(EvaluationError, match="task e: expected file missing: cache_file 'absent.txt'"):
        env.evaluate()


# -- coverage -------------------------------------------------------------------------------------------------
@needs_osworld
def test_coverage_cli_prints_every_domain(capsys):
    from envs.osworld import coverage

    assert coverage.main([str(OSWORLD)]) == 0
    out = capsys.readouterr().out
    for d in ("chrome", "gimp", "libreoffice_calc", "os", "vs_code", "all"):
        assert any(line.startswith(d) for line in out.splitlines())
    assert "369" in out.splitlines()[-1]
    rep = coverage.report(load_osworld(OSWORLD))
    assert sum(d["total"] for d in rep.values()) == 369
    chrome = rep["chrome"]
    assert chrome["missing"]["setup step 'chrome_open_tabs'"] > 0 and chrome["runnable"] < chrome["total"]
    if not any(coverage.shutil.which(p) for p in ("google-chrome", "chromium")):  # .ci/setup_desktop.sh installs chromium
        assert chrome["runnable"] == 0


def test_local_suite_is_fully_covered_statically():
    from envs.osworld import coverage
    from envs.osworld.local import load_local_tasks

    tasks = load_local_tasks()
    assert len(tasks) >= 20
    if coverage.shutil.which("libreoffice") and coverage.shutil.which("mousepad"):
        assert {t.id: coverage.task_needs(t) for t in tasks} == {t.id: [] for t in tasks}


def test_actions_before_a_control_action_still_run(tmp_path):
    ctl = FakeController()
    env = OSWorldEnv(ctl, cache_root=str(tmp_path), settle_s=0, wait_s=0)
    env.reset(_task({"func": "infeasible"}))
    r = env.step([Action(ActionType.TYPE, text="abc"), Action(ActionType.FINISHED)])
    assert r.done and env.history == ["DONE"]
    assert "pyautogui.write('abc'" in ctl.calls[-1][1]
    assert env.evaluate() == 0.0  # infeasible task ended with DONE, not FAIL


@pytest.mark.hostile
@pytest.mark.parametrize("bad_id", ["../victim", "/tmp/victim", "a/../../victim", "..", "a/b", ""])
def test_a_task_id_cannot_reach_outside_the_cache(tmp_path, bad_id):
    """reset empties the cache directory named by the task id: an id with separators or '..' would delete
    a directory outside the cache."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    cache = tmp_path / "cache"
    env = OSWorldEnv(FakeController(), cache_root=str(cache), settle_s=0, wait_s=0)
    task = Task.from_dict({"id": bad_id, "instruction": "do", "config": [], "evaluator": {"func": "infeasible"}})
    with pytest.raises(TaskError, match="task id"):
        env.reset(task)
    assert (victim / "keep.txt").read_text() == "x"


def _command_task():
    return _task({"func": "exact_match", "result": {"type": "vm_command_line", "command": "cat ~/out.txt"},
                  "expected": {"type": "rule", "rules": {"expected": "done"}}})


@pytest.mark.hostile
def test_an_unreachable_server_during_evaluation_is_an_environment_error_not_a_zero(tmp_path):
    """A server that died mid-episode used to score the episode 0, a failure the policy was trained on."""
    ctl = FakeController()
    env = OSWorldEnv(ctl, cache_root=str(tmp_path), settle_s=0, wait_s=0)
    env.reset(_command_task())
    ctl.execute_results = [ControllerError("POST /execute: connection refused", status=503, transient=True)]
    with pytest.raises(EvaluationError, match="connection refused"):
        env.evaluate()
    env.reset(_command_task())
    ctl.execute_results = [ControllerError("POST /execute: HTTP 500: bad command", status=500)]
    assert env.evaluate() == 0.0  # an answered failure is still the task's failure


@pytest.mark.hostile
def test_http_controller_calls_to_a_dead_server_raise_instead_of_answering_none():
    import socket

    from envs.client import HttpController

    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctl = HttpController(f"http://127.0.0.1:{port}", retry_times=2, retry_interval_s=0.0)
    for call in (lambda: ctl.get_file("/home/user/out.txt"), lambda: ctl.list_directory("/home/user"),
                 ctl.terminal_output, ctl.accessibility_tree):
        with pytest.raises(ControllerError) as err:
            call()
        assert err.value.transient
