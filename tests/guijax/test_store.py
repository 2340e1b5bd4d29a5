"""TrajectoryStore: exact round trip of every field, random access across shards, atomic shards (an exception or
a SIGKILL mid-write leaves no shard under a real name), grain reads the files, clear errors for bad records."""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest

from guijax.data.store import StoreError, TrajectoryStore, decode_trajectory, encode_trajectory
from guijax.rollout.trajectory import Source, Status, Step, Trajectory


def make_trajectory(seed: int, task_id: str = "task", steps: int = 2, status=Status.DONE, source=Source.ON_POLICY,
                    sampled: bool = True) -> Trajectory:
    rs = np.random.RandomState(seed)
    out = []
    for i in range(steps):
        n = int(rs.randint(1, 6)) if sampled else 0
        out.append(Step(screenshot=rs.randint(0, 256, (56 + 28 * (i % 2), 84, 3), dtype=np.uint8),
                        response=f"Thought: step {i} of {task_id}\nAction: click(start_box='(1,2)')",
                        response_tokens=rs.randint(0, 1000, n).astype(np.int32),
                        behaviour_logprobs=-rs.rand(n).astype(np.float32),
                        actions=[f"pyautogui.click({i}, 2)"] if i % 2 == 0 else [],
                        error=None if i else "parse error: ünïcode"))
    return Trajectory(task_id, f"Open the {task_id} menu", out, reward=float(rs.rand()), status=status, source=source,
                      plan=("open", "click") if seed % 2 else (), error=None if seed % 3 else "env died",
                      meta={"seed": seed, "times": [0.5, np.float32(1.25)], "plan": ("a", "b"), "nested": {"k": None},
                            "array": np.arange(6, dtype=np.int16).reshape(2, 3), "empty": np.zeros((0, 4), np.float64)})


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "steps":
            assert len(x) == len(y)
            for sa, sb in zip(x, y):
                for g in dataclasses.fields(Step):
                    u, v = getattr(sa, g.name), getattr(sb, g.name)
                    if isinstance(u, np.ndarray):
                        assert u.dtype == v.dtype and u.shape == v.shape, g.name
                        np.testing.assert_array_equal(u, v)
                    else:
                        assert u == v and type(u) is type(v), g.name
        elif f.name == "meta":
            assert x.keys() == y.keys()
            for k in x:
                if isinstance(x[k], np.ndarray):
                    assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                    np.testing.assert_array_equal(x[k], y[k])
                else:
                    assert x[k] == y[k] and type(x[k]) is type(y[k]), k
        else:
            assert x == y and type(x) is type(y), f.name


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("source", list(Source))
def test_record_round_trip_every_field(status, source):
    traj = make_trajectory(len(status.value) + len(source.value), status=status, source=source,
                           sampled=source is not Source.EXPERT)
    back = decode_trajectory(encode_trajectory(traj))
    # numpy scalars in meta come back as Python numbers; compare against that normalisation
    traj.meta["times"] = [0.5, 1.25]
    assert_same(traj, back)
    assert isinstance(back.status, Status) and isinstance(back.source, Source) and isinstance(back.plan, tuple)


def test_empty_arrays_and_steps_round_trip():
    traj = make_trajectory(3, steps=1, sampled=False)
    assert traj.steps[0].response_tokens.shape == (0,)
    back = decode_trajectory(encode_trajectory(traj))
    assert back.steps[0].response_tokens.dtype == np.int32 and back.steps[0].response_tokens.shape == (0,)
    assert back.steps[0].behaviour_logprobs.dtype == np.float32 and back.meta["empty"].shape == (0, 4)
    no_steps = dataclasses.replace(traj, steps=[])
    assert decode_trajectory(encode_trajectory(no_steps)).steps == []


def test_store_random_access_across_shards(tmp_path):
    store = TrajectoryStore(tmp_path)
    assert len(store) == 0 and list(store) == []
    first = [make_trajectory(i, task_id=f"t{i % 2}") for i in range(3)]
    second = [make_trajectory(10 + i, task_id=f"t{i % 3}", steps=1) for i in range(2)]
    p1, p2 = store.append(first), store.append(second)
    assert p1.name == "shard-000000.array_record" and p2.name == "shard-000001.array_record"
    assert len(store) == 5
    everything = first + second
    for i in [4, 0, 3, 2, 1, -1]:
        assert_same(store[i], everything[i])
    assert [t.task_id for t in store] == [t.task_id for t in everything]
    assert [t.meta["seed"] for t in store.by_task("t1")] == [1, 11]
    assert store.summaries() == [(t.task_id, len(t.steps)) for t in everything]
    with pytest.raises(IndexError, match="out of range"):
        store[5]
    reopened = pickle.loads(pickle.dumps(store))  # grain workers receive the store pickled
    assert len(reopened) == 5 and reopened[3].meta["seed"] == 10
    later = TrajectoryStore(tmp_path)
    later.append([make_trajectory(20)], name="replay")
    store.refresh()
    assert len(store) == 6 and store.shards[-1].name == "shard-000001.array_record"  # name order
    with pytest.raises(StoreError, match="already exists"):
        store.append([make_trajectory(21)], name="replay")


def test_grain_reads_the_shards(tmp_path):
    import grain

    store = TrajectoryStore(tmp_path)
    store.append([make_trajectory(i, task_id=f"t{i}") for i in range(2)])
    store.append([make_trajectory(5, task_id="t5")])
    source = grain.sources.ArrayRecordDataSource(store.paths())
    assert len(source) == 3
    assert [decode_trajectory(source[i]).task_id for i in range(3)] == ["t0", "t1", "t5"]


@pytest.mark.hostile
def test_exception_mid_write_leaves_no_shard(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.append([make_trajectory(0)])
    bad = make_trajectory(2, task_id="broken")
    bad.steps[1].screenshot = bad.steps[1].screenshot.astype(np.float32)
    with pytest.raises(StoreError, match="task broken step 1: screenshot must be uint8"):
        store.append([make_trajectory(1), bad, make_trajectory(3)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.array_record"]
    assert len(TrajectoryStore(tmp_path)) == 1
    store.append([make_trajectory(4)])
    assert len(store) == 2 and store[1].meta["seed"] == 4


@pytest.mark.hostile
def test_sigkill_mid_write_leaves_no_shard(tmp_path):
    """A process killed (os._exit, no cleanup) half-way through a shard leaves only a hidden temp file."""
    store = TrajectoryStore(tmp_path)
    store.append([make_trajectory(0)])
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_store import make_trajectory
        from guijax.data.store import TrajectoryStore

        def dying():
            yield make_trajectory(1)
            yield make_trajectory(2)
            os._exit(9)  # killed mid-shard: no exception handler, no cleanup

        TrajectoryStore({str(tmp_path)!r}).append(dying())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".")
    fresh = TrajectoryStore(tmp_path)
    assert len(fresh) == 1 and [p.name for p in fresh.shards] == ["shard-000000.array_record"]
    assert fresh.append([make_trajectory(3)]).name == "shard-000001.array_record"
    assert len(fresh) == 2


@pytest.mark.hostile
def test_bad_records_name_the_place(tmp_path):
    with pytest.raises(StoreError, match="shard-x record 3: not a msgpack"):
        decode_trajectory(b"\xc1garbage", where="shard-x record 3")
    future = msgpack.packb({"format": "guijax.trajectory", "version": 99, "trajectory": {}})
    with pytest.raises(StoreError, match="version 99 is not supported"):
        decode_trajectory(future)
    with pytest.raises(StoreError, match="not a guijax.trajectory record"):
        decode_trajectory(msgpack.packb({"hello": 1}))
    with pytest.raises(StoreError, match="task odd: cannot store a value of type object"):
        encode_trajectory(dataclasses.replace(make_trajectory(0, task_id="odd"), meta={"x": object()}))


@pytest.mark.hostile
@pytest.mark.parametrize("damage", ["truncate", "zero"])
def test_a_damaged_shard_is_an_error_naming_it_not_zero_records(tmp_path, damage):
    """A damaged shard used to read as 0 records: every later record moved to another global index, and a
    restored replay buffer or cache silently held other trajectories."""
    store = TrajectoryStore(tmp_path)
    store.append([make_trajectory(1, task_id="a"), make_trajectory(2, task_id="b")], name="iter-000000")
    store.append([make_trajectory(3, task_id="c")], name="iter-000001")
    shard = store.shards[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\0" * len(data))
    with pytest.raises(StoreError, match=r"iter-000000\.array_record"):
        TrajectoryStore(tmp_path)


def test_an_empty_shard_is_not_damage(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.append([], name="d_self")
    store.append([make_trajectory(3, task_id="c")])
    assert [t.task_id for t in TrajectoryStore(tmp_path)] == ["c"]


@pytest.mark.hostile
def test_a_flipped_bit_is_an_error_naming_the_shard_or_changes_nothing(tmp_path):
    """ArrayRecord checks each chunk's hash; a flip used to escape as the reader's bare RuntimeError. A flip
    in padding changes nothing; no flip may return a different trajectory."""
    written = [make_trajectory(i, task_id=f"t{i}") for i in range(3)]
    TrajectoryStore(tmp_path / "clean").append(written, name="iter-000000")
    data = (tmp_path / "clean" / "iter-000000.array_record").read_bytes()
    outcomes = set()
    for n, position in enumerate(range(7, len(data), max(1, len(data) // 40))):
        copy = tmp_path / f"copy{n}"
        copy.mkdir()
        flipped = bytearray(data)
        flipped[position] ^= 0x10
        (copy / "iter-000000.array_record").write_bytes(bytes(flipped))
        try:
            store = TrajectoryStore(copy)
            for a, b in zip(written, store, strict=True):
                assert_same(a, b)
            outcomes.add("unchanged")
        except StoreError as e:
            assert "iter-000000.array_record" in str(e)
            outcomes.add("error")
    assert "error" in outcomes  # the sweep reached the records
