"""Task loading (files, directories, list files), ids, errors that name the file/key, generation, splits."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from envs.api import Task, TaskError
from envs.desk import FAMILIES, DeskEnv
from envs.tasks import by_id, generate_desk_tasks, load_tasks, save_tasks, split, split_tasks


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(2 * len(FAMILIES), seed=3)


def test_task_files_round_trip_and_errors(tasks, tmp_path):
    path = save_tasks(tasks, tmp_path / "tasks.json")
    loaded = load_tasks(path)
    assert [t.id for t in loaded] == [t.id for t in tasks]
    assert by_id(loaded, tasks[3].id).instruction == tasks[3].instruction
    with pytest.raises(TaskError, match="unknown task id 'nope'"):
        by_id(loaded, "nope")
    bad = tmp_path / "bad" / "t.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"id": "x"}))
    with pytest.raises(TaskError, match=r"t\.json: missing required key 'instruction'"):
        load_tasks(bad.parent)
    bad.write_text("{not json")
    with pytest.raises(TaskError, match="invalid JSON"):
        load_tasks(bad)
    with pytest.raises(TaskError, match="unknown desk task families"):
        generate_desk_tasks(1, families=["juggling"])
    with pytest.raises(TaskError, match="expected exactly one 'desk_scene'"):
        DeskEnv().reset(Task(id="t", instruction="x"))


def test_a_saved_task_still_finds_the_files_beside_its_own_file(tmp_path):
    """A run saves its tasks to one list (tasks.json); a task's relative download URL must still resolve
    against the folder of the file it came from, or its setup fails on the desktop."""
    import os

    from envs.desktop.cache import fetch_bytes

    (tmp_path / "tasks" / "assets").mkdir(parents=True)
    (tmp_path / "tasks" / "assets" / "doc.txt").write_text("the document")
    (tmp_path / "tasks" / "editor").mkdir()
    download = {"type": "download", "parameters": {"files": [{"url": "../assets/doc.txt", "path": "~/doc.txt"}]}}
    (tmp_path / "tasks" / "editor" / "t.json").write_text(json.dumps({"id": "t", "instruction": "edit",
                                                                       "config": [download]}))
    (original,) = load_tasks(tmp_path / "tasks" / "editor")
    saved = load_tasks(save_tasks([original], tmp_path / "run" / "tasks.json"))
    again = load_tasks(save_tasks(saved, tmp_path / "other" / "tasks.json"))
    for (task,) in (saved, again):
        assert task.source == original.source and task.to_dict() == original.to_dict()
        assert fetch_bytes("../assets/doc.txt", "~/doc.txt", (), os.path.dirname(task.source)) == b"the document"
    (generated,) = load_tasks(save_tasks(generate_desk_tasks(1, seed=0), tmp_path / "desk.json"))
    assert generated.source == f"{tmp_path / 'desk.json'}[0]"  # a task of no file is named by its place in the list


@pytest.mark.parametrize("content, message", [
    (b'{"id": "x", "instruction": "caf\xe9"}', "is not UTF-8 text"),  # Latin-1 bytes
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"", "invalid JSON"),
])
@pytest.mark.hostile
def test_unreadable_task_files_are_named(tmp_path, content, message):
    from envs.osworld.loader import load_split

    bad = tmp_path / "chrome" / "t.json"
    bad.parent.mkdir()
    bad.write_bytes(content)
    for load in (load_tasks, Task.from_file, lambda p: load_split(p, tmp_path)):
        with pytest.raises(TaskError, match=message) as err:
            load(bad)
        assert str(bad) in str(err.value)


def test_splits(tasks):
    splits = split_tasks(tasks, held_out_families=["fill_form"], held_out_fraction=0.25, seed=1)
    assert all(t.domain != "fill_form" for t in splits["train"])
    assert len(splits["train"]) + len(splits["held_out"]) == len(tasks)
    assert split_tasks(tasks, held_out_fraction=0.25, seed=1) == split_tasks(tasks, held_out_fraction=0.25, seed=1)

    assert split is split_tasks


def test_evaluator_typos_name_the_task_and_key(tasks):
    task = next(t for t in tasks if t.domain == "type_field")
    env = DeskEnv(popups=False)
    for expected, message in (({"Profle": {}}, "expected names window 'Profle'"),
                              ({"Profile": {"widgets": {"Nme": {"text": "x"}}}}, "window 'Profile' has no stateful widget 'Nme'"),
                              ({"Profile": {"widgets": {task.extra["expert"][0]["target"]: {"txt": "x"}}}},
                               "unknown widget property 'txt'")):
        bad = Task.from_dict({**task.to_dict(), "evaluator": {"func": "desk_state", "expected": expected}},
                             source="bad.json")
        env.reset(bad)
        with pytest.raises(TaskError, match=rf"task {task.id} \(bad\.json\): evaluator: desk_state: {message}"):
            env.evaluate()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["id", "instruction", "config", "evaluator", "func", "result", "expected",
                                          "type", "parameters", "options", "family", "x"]) | st.text(max_size=4),
                         inner, max_size=5), max_leaves=20)


def _loads_or_names_the_file(path):
    from envs.osworld.loader import parse_task

    try:
        for task in load_tasks(path):
            parse_task(task)
    except TaskError as e:
        assert path.name in str(e), str(e)


@pytest.mark.hostile
@settings(max_examples=150, deadline=None)
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_load_as_tasks_or_a_task_error_naming_the_file(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("fuzz") / "task.json"
    path.write_bytes(content)
    _loads_or_names_the_file(path)


@pytest.mark.hostile
@settings(max_examples=150, deadline=None)
@given(data=_JSON | st.fixed_dictionaries({"id": st.text(max_size=6), "instruction": st.text(max_size=6)},
                                          optional={"config": _JSON, "evaluator": _JSON}))
def test_any_json_loads_as_tasks_or_a_task_error_naming_the_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "task.json"
    path.write_text(json.dumps(data))
    _loads_or_names_the_file(path)
