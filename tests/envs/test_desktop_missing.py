"""A machine without the desktop's programs gets an error naming them and the script that installs them, not a
traceback from deep inside subprocess (runs everywhere: the programs are hidden, not needed)."""
import pytest

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


def test_missing_xvfb_is_a_clear_error(monkeypatch):
    from envs.desktop import display

    monkeypatch.setattr(display.shutil, "which", lambda name: None)
    with pytest.raises(display.DesktopError, match=r"missing programs \['Xvfb', 'openbox'\].*setup_desktop.sh"):
        display.Display((320, 240))


def test_the_desktop_check_names_what_is_missing(monkeypatch):
    from envs.desktop import checks

    monkeypatch.setattr(checks.shutil, "which", lambda name: None if name == "Xvfb" else "/usr/bin/" + name)
    assert checks.desktop_missing().startswith("missing programs ['Xvfb']: bash .ci/setup_desktop.sh")
