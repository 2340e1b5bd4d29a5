"""write_text_atomic replaces a file whole and leaves no temporary file behind."""
from envs.atomic import write_text_atomic


def test_replaces_the_file_and_leaves_no_tmp(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    assert write_text_atomic(path, '{"new": 1}') == path
    assert path.read_text() == '{"new": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
