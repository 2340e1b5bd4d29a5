"""A resume survives a bad checkpoint: the newest step that restores is used, the broken ones are set aside
(never deleted), and saving continues past them."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from guijax.checkpoint import Checkpointer

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


def _state(value: float) -> dict:
    return {"w": np.full((4,), value, np.float32)}


def _saved(directory: pathlib.Path, steps=(1, 2, 3)) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=5, async_save=False)
    for step in steps:
        ckpt.save(step, _state(float(step)), {"iteration": step})
    ckpt.wait()
    return ckpt


def _use(state, meta):
    return float(state["w"][0]), int(meta["iteration"])


def _meta_files(directory: pathlib.Path, step: int) -> list[pathlib.Path]:
    return [p for p in (directory / str(step) / "meta").rglob("*") if p.is_file()]


def test_a_corrupted_latest_step_falls_back_to_the_one_before(tmp_path):
    ckpt = _saved(tmp_path)
    for f in _meta_files(tmp_path, 3):
        f.write_text("{torn")  # a meta item cut off mid-write
    step, (value, iteration) = ckpt.restore_latest(_state(0.0), _use)
    assert (step, value, iteration) == (2, 2.0, 2)
    assert (tmp_path / "3.unreadable-0").is_dir() and not (tmp_path / "3").exists()
    ckpt.save(3, _state(30.0), {"iteration": 3})  # the redone step saves where the broken one was
    ckpt.wait()
    assert ckpt.restore_latest(_state(0.0), _use) == (3, (30.0, 3))
    ckpt.close()


def test_a_step_whose_meta_lacks_what_the_run_needs_is_set_aside(tmp_path):
    ckpt = _saved(tmp_path)
    for f in _meta_files(tmp_path, 3):
        f.write_text(json.dumps({"not_iteration": 1}))
    assert ckpt.restore_latest(_state(0.0), _use) == (2, (2.0, 2))
    ckpt.close()


def test_no_readable_step_means_a_fresh_start_with_the_broken_ones_kept(tmp_path):
    ckpt = _saved(tmp_path, steps=(1,))
    for f in _meta_files(tmp_path, 1):
        f.write_text("")
    assert ckpt.restore_latest(_state(0.0), _use) is None
    assert (tmp_path / "1.unreadable-0").is_dir()
    ckpt.close()


def test_an_intact_checkpoint_restores_its_newest_step(tmp_path):
    ckpt = _saved(tmp_path)
    assert ckpt.restore_latest(_state(0.0), _use) == (3, (3.0, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]
    ckpt.close()


def test_an_empty_directory_restores_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path / "none", async_save=False)
    assert ckpt.restore_latest(_state(0.0), _use) is None
    ckpt.close()


@pytest.fixture(autouse=True)
def _quiet_orbax(caplog):
    caplog.set_level("ERROR", logger="absl")


def test_a_flipped_bit_in_the_array_data_falls_back_instead_of_restoring_a_wrong_weight(tmp_path):
    """Orbax checks its indexes but not the array bytes: random (incompressible) weights are stored as they
    are, so a flipped bit in the data file used to restore as a silently different weight."""
    weights = {s: {"w": np.random.RandomState(s).standard_normal(4096).astype(np.float32)} for s in (1, 2)}
    ckpt = Checkpointer(tmp_path, keep=5, async_save=False)
    for step, state in weights.items():
        ckpt.save(step, state, {"iteration": step})
    ckpt.close()
    data = max((p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    data.write_bytes(bytes(flipped))
    ckpt = Checkpointer(tmp_path, keep=5, async_save=False)
    step, (w, iteration) = ckpt.restore_latest(_state(0.0) | {"w": np.zeros(4096, np.float32)},
                                               lambda s, m: (np.asarray(s["w"]), m["iteration"]))
    assert (step, iteration) == (1, 1) and (tmp_path / "2.unreadable-0").is_dir()
    np.testing.assert_array_equal(w, weights[1]["w"])
    ckpt.close()


def test_a_changed_json_item_is_caught(tmp_path):
    """A digit changed in the JSON item (still valid JSON) would resume at another iteration."""
    ckpt = _saved(tmp_path, steps=(1, 2))
    for f in _meta_files(tmp_path, 2):
        if '"iteration": 2' in f.read_text():
            f.write_text(f.read_text().replace('"iteration": 2', '"iteration": 7'))
    assert ckpt.restore_latest(_state(0.0), _use) == (1, (1.0, 1))
    ckpt.close()
