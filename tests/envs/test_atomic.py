"""write_text_atomic replaces a file whole and leaves no temporary file behind."""
import pytest

from envs.atomic import write_text_atomic

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


def test_replaces_the_file_and_leaves_no_tmp(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    assert write_text_atomic(path, '{"new": 1}') == path
    assert path.read_text() == '{"new": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):

    path = tmp_path / "splits.json"
    path.write_text("old")

    class Unwritable:
        def __str__(self):
            raise RuntimeError("disk full")

    with pytest.raises(TypeError):
        write_text_atomic(path, Unwritable())  # write() refuses a non-str: the rename never happens
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["splits.json"]


def test_concurrent_writers_use_distinct_temporaries(tmp_path):
    import threading

    path = tmp_path / "table.json"
    texts = [f'{{"writer": {i}}}' * 2000 for i in range(8)]
    errors = []

    def write(text):
        try:
            write_text_atomic(path, text)
        except Exception as e:  # a shared temporary makes one writer's rename find it gone
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_text() in texts  # one whole text, never a mix of two
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]
