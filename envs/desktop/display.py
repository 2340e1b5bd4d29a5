"""An Xvfb display, an optional window manager and a private HOME: the base of the local desktop.

Why `-displayfd`: Xvfb itself picks the first free display number and holds its lock file, so two desktops
started at the same moment (one per pool worker) never collide, which probing `/tmp/.X*-lock` from Python
cannot guarantee. The desktop gets its own HOME so tasks that write under `~` never touch the user's files.
"""
from __future__ import annotations

import os
import pathlib
import select
import shutil
import subprocess
import tempfile
import time

from envs.desktop.reaper import Reaper

WINDOW_MANAGERS = ("openbox",)

# LibreOffice settings for an unattended desktop: no first-run / tip-of-the-day dialog, no "keep current
# format?" question when saving xlsx/docx, no document-recovery dialog after an app was killed.
_LO_REGISTRY = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="FirstRun" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Setup/Office"><prop oor:name="FirstStartWizardCompleted" oor:op="fuse"><value>true</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Save/Document"><prop oor:name="WarnAlienFormat" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Recovery/AutoSave"><prop oor:name="Enabled" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Recovery/RecoveryInfo"><prop oor:name="Enabled" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="UseSystemFileDialog" oor:op="fuse"><value>false</value></prop></item>
</oor:items>
"""


class DesktopError(RuntimeError):
    """The desktop could not be started (missing binary, Xvfb failure); the message says which."""


def missing_binaries(window_manager: str | None = "openbox") -> list[str]:
    need = ["Xvfb"] + ([window_manager] if window_manager else [])
    return [b for b in need if shutil.which(b) is None]


class Display:
    """Xvfb on a free display number, plus an optional window manager, owned by a `Reaper`.

    `env` is the environment every process on this desktop should get (DISPLAY, HOME, ...).
    """

    def __init__(self, size: tuple[int, int] = (1920, 1080), window_manager: str | None = "openbox",
                 home: str | os.PathLike | None = None, start_timeout_s: float = 20.0,
                 reaper: Reaper | None = None):
        missing = missing_binaries(window_manager)
        if missing:
            raise DesktopError(f"missing programs {missing}: run .ci/setup_desktop.sh (apt-get install xvfb openbox ...)")
        self.width, self.height = int(size[0]), int(size[1])
        self.managed = True  # we started Xvfb and own HOME
        self.reaper = reaper or Reaper()
        self._own_reaper = reaper is None
        self._tmp = tempfile.mkdtemp(prefix="guijax-desktop-")
        self.home = pathlib.Path(home) if home else pathlib.Path(self._tmp) / "home"
        self.xvfb = None
        self.env = {}
        try:
            self._start(home, start_timeout_s, window_manager)
        except BaseException:
            self.close()
            raise

    def _start(self, home, start_timeout_s: float, window_manager: str | None) -> None:
        self._prepare_home()
        self.number = self._start_xvfb(start_timeout_s)
        self.name = f":{self.number}"
        self.env = self._make_env()
        if shutil.which("tmux"):  # the local terminal runs tmux, whose server daemonizes out of our groups
            self.reaper.on_crash(["tmux", "kill-server"], {"TMUX_TMPDIR": self._tmp})
        self.reaper.on_crash(["rm", "-rf", self._tmp])
        self.window_manager = None
        if window_manager:
            self.window_manager = self.reaper.popen([window_manager], env=self.env, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
            self._wait_wm(start_timeout_s)
        self.base_pids = frozenset(self.reaper.pids())

    @classmethod
    def attach(cls, name: str, home: str | os.PathLike | None = None) -> "Display":
        """An X display someone else runs (an OSWorld VM's :0, a VNC session): apps we launch on it are
        still cleaned up, but Xvfb, the window manager and the user's HOME and settings are left alone."""
        self = cls.__new__(cls)
        self.managed = False
        self.reaper = Reaper()
        self._own_reaper = True
        self._tmp = tempfile.mkdtemp(prefix="guijax-desktop-")
        self.home = pathlib.Path(home or os.path.expanduser("~"))
        self.number = int(name.lstrip(":").split(".")[0])
        self.name = name
        self.xvfb = None
        self.window_manager = None
        env = dict(os.environ)
        env.update({"DISPLAY": name, "HOME": str(self.home), "TMUX_TMPDIR": self._tmp})
        self.env = env
        from envs.desktop.screen import Screen

        self.width, self.height = Screen(name).size()
        self.base_pids = frozenset()
        return self

    # -- start-up -------------------------------------------------------------------------------------------
    def _prepare_home(self) -> None:
        for sub in ("Desktop", "Documents", "Downloads", ".config/libreoffice/4/user"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        self.reset_app_profiles()

    def reset_app_profiles(self) -> None:
        """Rewrite LibreOffice's settings and drop its backups, so a killed instance leaves no recovery prompt."""
        if not getattr(self, "managed", True):
            return
        user = self.home / ".config/libreoffice/4/user"
        (user / "registrymodifications.xcu").write_text(_LO_REGISTRY)
        shutil.rmtree(user / "backup", ignore_errors=True)
        for lock in self.home.rglob(".~lock.*#"):
            lock.unlink(missing_ok=True)

    def _start_xvfb(self, timeout_s: float) -> int:
        read_fd, write_fd = os.pipe()
        try:
            self.xvfb = self.reaper.popen(
                ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", f"{self.width}x{self.height}x24",
                 "-nolisten", "tcp", "-noreset", "+extension", "XTEST"],
                pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            os.close(write_fd)
            write_fd = -1
            data = b""
            deadline = time.monotonic() + timeout_s
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or self.xvfb.poll() is not None:
                    err = b""
                    if self.xvfb.poll() is not None and self.xvfb.stderr:
                        err = self.xvfb.stderr.read()[-500:]
                    self.reaper.kill(self.xvfb)
                    raise DesktopError(f"Xvfb did not report a display within {timeout_s}s: {err.decode(errors='replace')}")
                ready, _, _ = select.select([read_fd], [], [], left)
                if ready:
                    chunk = os.read(read_fd, 64)
                    if not chunk:
                        continue
                    data += chunk
            return int(data.strip())
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)

    def _make_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"DISPLAY": f":{self.number}", "HOME": str(self.home), "NO_AT_BRIDGE": "1",
                    "XDG_CONFIG_HOME": str(self.home / ".config"), "SAL_USE_VCLPLUGIN": "gen",
                    "XDG_RUNTIME_DIR": self._tmp, "TMUX_TMPDIR": self._tmp,
                    "SHELL": shutil.which("bash") or env.get("SHELL", "/bin/sh")})
        env.pop("XAUTHORITY", None)
        env.pop("WAYLAND_DISPLAY", None)
        env.pop("DBUS_SESSION_BUS_ADDRESS", None)
        return env

    def _wait_wm(self, timeout_s: float) -> None:
        if shutil.which("wmctrl") is None:
            time.sleep(0.5)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if subprocess.run(["wmctrl", "-m"], env=self.env, capture_output=True).returncode == 0:
                return
            if self.window_manager is not None and self.window_manager.poll() is not None:
                raise DesktopError(f"window manager exited with code {self.window_manager.returncode}")
            time.sleep(0.1)
        raise DesktopError(f"window manager not ready on {self.name} within {timeout_s}s")

    # -- life cycle -----------------------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.xvfb is None or self.xvfb.poll() is None

    def kill_apps(self) -> None:
        """Kill everything started on this desktop except Xvfb and the window manager."""
        self._kill_tmux()
        self.reaper.kill_all(except_pids=self.base_pids, grace_s=0.5)

    def _kill_tmux(self) -> None:
        if shutil.which("tmux") and self.env:
            subprocess.run(["tmux", "kill-server"], env=self.env, capture_output=True, timeout=10)

    def close(self) -> None:
        self._kill_tmux()
        if self._own_reaper:
            self.reaper.close()
        else:
            self.reaper.kill_all()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Display":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
