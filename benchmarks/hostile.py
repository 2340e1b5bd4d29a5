"""The standing hostile-input and fault campaigns: random inputs and injected faults, counted.

Each campaign tries many inputs of one kind and sorts every outcome into: accepted intact (a valid action,
the exact data saved), refused cleanly (the documented error, naming the file, shard or input), escaped (any
other exception, or an error that does not say where) and lost (wrong data returned without an error). The
targets are escaped = 0 and lost = 0; the README's table is this script's output at the `full` budget:

    python benchmarks/hostile.py --budget full --json benchmarks/results/hostile.json \\
        --markdown benchmarks/results/hostile.md

Campaigns: every action parser (UI-TARS 1.0/1.5, computer_use, pyautogui, S2) on mutated model outputs; the task
loaders (desk and OSWorld files) on mutated files; the trajectory store and the checkpoints on damaged
copies; the environment pool under killed and hung workers; the environment server under concurrent,
oversized, half-sent and idle connections, with its threads and memory measured. `pytest -m hostile` runs
them at the `smoke` budget beside the targeted hostile-input tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
from typing import Any, Callable

from bench_common import ROOT, command_line, machine_info, write_outputs

import numpy as np

SHARED_OSWORLD = ROOT.parent / "shared" / "osworld" / "examples"
LOCAL_TASKS = ROOT / "envs" / "osworld" / "local_tasks"


@dataclasses.dataclass
class Tally:
    """What one campaign tried and how each try ended."""

    campaign: str
    inputs: int = 0
    faults: int = 0
    accepted: int = 0
    refused: int = 0
    escaped: list[str] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["escaped"], out["lost"] = len(self.escaped), len(self.lost)
        out["escaped_examples"], out["lost_examples"] = self.escaped[:5], self.lost[:5]
        return out


def _timed(campaign: Callable[..., Tally]) -> Callable[..., Tally]:
    def run(*args, **kwargs) -> Tally:
        start = time.monotonic()
        tally = campaign(*args, **kwargs)
        tally.seconds = round(time.monotonic() - start, 2)
        return tally
    run.__name__ = campaign.__name__
    return run


# ------------------------------------------------------------------------------------------ mutations
_JUNK = ["(", ")", "[", "]", "{", "}", "'", '"', "\\", ",", "=", ":", "\n", " ", "\x00", "é", "\U0001F600",
         "nan", "inf", "-1", "1e309", "9" * 400, "<|box_start|>", "<|box_end|>", "<point>", "</point>",
         "<tool_call>", "</tool_call>", "Action:", "Thought:", "agent.", "lambda", "**", "None", "null", "true"]


def mutate_text(text: str, rng: random.Random) -> str:
    """One to four edits of the kinds a sampler or a truncated reply produces, plus deep nesting."""
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        i = rng.randrange(len(text) + 1)
        j = min(len(text), i + rng.randint(1, 12))
        if op == 0:
            text = text[:i] + rng.choice(_JUNK) + text[i:]
        elif op == 1:
            text = text[:i] + text[j:]
        elif op == 2:
            text = text[:i] + text[i:j] * rng.randint(2, 5) + text[j:]
        elif op == 3:
            text = text[:i]
        elif op == 4:
            depth = rng.choice([50, 1000, 20000])
            text = text[:i] + rng.choice("([{") * depth + text[i:]
        elif op == 5:
            text = "".join(ch if not ch.isdigit() or rng.random() > 0.5 else rng.choice(["", "-", ".", "e", "99"])
                           for ch in text)
        else:
            text = text[:i] + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randint(1, 8))) + text[i:]
    return text


def mutate_json(value: Any, rng: random.Random) -> Any:
    """A structural edit at a random place: a key removed, a value of the wrong type, a huge or deep value."""
    replacements = [None, -1, 0, 1e308, "", "x" * 5000, [], {}, [1, "a", None], True, {"type": 3}, "../../etc"]
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        value = dict(value)
        if rng.random() < 0.3:
            del value[key]
        else:
            value[key] = mutate_json(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        value = list(value)
        k = rng.randrange(len(value))
        value[k] = mutate_json(value[k], rng)
        return value
    return rng.choice(replacements)


def damage_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A flipped bit, a truncation, a zeroed range, appended garbage or an empty file."""
    if not data:
        return b"\xff", "garbage"
    kind = rng.choice(["flip", "flip", "truncate", "zero", "append", "empty"])
    if kind == "flip":
        out = bytearray(data)
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out), kind
    if kind == "truncate":
        return data[:rng.randrange(len(data))], kind
    if kind == "zero":
        i = rng.randrange(len(data))
        j = min(len(data), i + rng.randint(1, 4096))
        return data[:i] + b"\0" * (j - i) + data[j:], kind
    if kind == "append":
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), kind
    return b"", kind


def damaged_copy(clean: pathlib.Path, copy: pathlib.Path, pick: Callable[[pathlib.Path], list[pathlib.Path]],
                 rng: random.Random) -> tuple[pathlib.Path, str]:
    """Copy `clean` to `copy` and damage one of the files `pick(copy)` lists (one in ten deleted)."""
    shutil.copytree(clean, copy)
    victim = rng.choice(sorted(pick(copy)))
    if rng.random() < 0.1:
        victim.unlink()
        return victim, "deleted"
    data, kind = damage_bytes(victim.read_bytes(), rng)
    victim.write_bytes(data)
    return victim, kind


# ------------------------------------------------------------------------------------------ parsers
def _parser_seeds() -> dict[str, tuple[Callable[[str], Any], list[str]]]:
    from envs.actions import parse_computer_use, parse_pyautogui, parse_s2, parse_uitars

    hw = (480, 640)
    uitars = ["Thought: open it\nAction: click(start_box='(120,45)')",
              "Action: drag(start_box='<|box_start|>(10,20)<|box_end|>', end_box='(300,400)')",
              "Thought: scroll\nAction: scroll(point='<point>500 300</point>', direction='down')",
              "Action: type(content='hello\\n')\n\nAction: hotkey(key='ctrl s')", "Action: finished(content='ok')",
              "Action: wait()"]
    computer_use = ['<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": '
                    '[100, 200]}}\n</tool_call>',
                    '<tool_call>{"name": "computer_use", "arguments": {"action": "type", "text": "hi"}}</tool_call>',
                    '{"name": "computer_use", "arguments": {"action": "scroll", "pixels": -3}}',
                    '<tool_call>{"name": "computer_use", "arguments": {"action": "key", "keys": ["ctrl", "c"]}}'
                    '</tool_call>']
    pyautogui = ["## Thought: open it\n## Action: click OK\n## Code:\n```python\npyautogui.click(120, 45)\n```",
                 "```python\npyautogui.moveTo(10, 20)\npyautogui.dragTo(300, 400, duration=0.5)\n```",
                 "```python\nimport pyautogui\npyautogui.hotkey('ctrl', 's')\npyautogui.write('hi\\n')\n```",
                 '## Code: ```python computer.terminate(status="success", answer="4")```',
                 "```python\npyautogui.scroll(-3, x=500, y=300)\ncomputer.wait()\n```"]
    s2 = ['agent.click("the OK button", 1, "left")', 'agent.type("name field", "Ada", overwrite=True)',
          'agent.scroll("the list", 3, False)', "agent.hotkey(['ctrl', 's'])", "agent.wait(1.5)", "agent.done()"]
    return {
        "uitars-1.5": (lambda t: parse_uitars(t, image_hw=hw, screen_hw=hw, model="uitars-1.5"), uitars),
        "uitars-1.0": (lambda t: parse_uitars(t, image_hw=hw, screen_hw=hw, model="uitars-1.0"), uitars),
        "computer_use": (lambda t: parse_computer_use(t, image_hw=hw, screen_hw=hw), computer_use),
        "pyautogui": (lambda t: parse_pyautogui(t, image_hw=(1000, 1000), screen_hw=hw), pyautogui),
        "s2": (parse_s2, s2),
    }


def _valid_actions(actions: Any) -> bool:
    """A parsed UI-TARS/computer_use result: actions whose points are integer pixels on the screen."""
    from envs.actions import Action

    if not isinstance(actions, list):
        return True  # an S2Action: parsed to its call
    for a in actions:
        if not isinstance(a, Action):
            return False
        for p in (a.point, a.end_point):
            if p is not None and not (isinstance(p[0], int) and isinstance(p[1], int)
                                      and 0 <= p[0] < 640 and 0 <= p[1] < 480):
                return False
    return True


@_timed
def parsers(n: int, seed: int) -> Tally:
    """Mutated model outputs through every parser: a valid action or ActionParseError carrying the text."""
    from envs.actions import ActionParseError

    tally = Tally("action parsers")
    rng = random.Random(seed)
    grammars = _parser_seeds()
    per = {name: 0 for name in grammars}
    for i in range(n):
        name = list(grammars)[i % len(grammars)]
        parse, seeds = grammars[name]
        text = mutate_text(rng.choice(seeds), rng)
        tally.inputs += 1
        per[name] += 1
        try:
            out = parse(text)
        except ActionParseError as e:
            if e.text == text:
                tally.refused += 1
            else:
                tally.escaped.append(f"{name}: ActionParseError without the text for {text[:80]!r}")
        except BaseException as e:  # noqa: BLE001 - anything else is what the campaign looks for
            if isinstance(e, KeyboardInterrupt):
                raise
            tally.escaped.append(f"{name}: {type(e).__name__} for {text[:80]!r}")
        else:
            if _valid_actions(out):
                tally.accepted += 1
            else:
                tally.lost.append(f"{name}: accepted {text[:80]!r} as {out!r:.120}")
    tally.notes["inputs_per_parser"] = per
    return tally


# ------------------------------------------------------------------------------------------ task files
def _task_sources() -> list[tuple[str, Any]]:
    from envs.tasks import generate_desk_tasks

    sources = [("desk", t.to_dict()) for t in generate_desk_tasks(6, seed=0)]
    files = sorted(LOCAL_TASKS.rglob("*.json"))
    if SHARED_OSWORLD.is_dir():
        files += sorted(SHARED_OSWORLD.rglob("*.json"))[::12]
    sources += [("osworld", json.loads(f.read_text())) for f in files]
    return sources


def _load_task_file(kind: str, path: pathlib.Path) -> Any:
    from envs.osworld.loader import parse_task
    from envs.tasks import load_tasks

    tasks = load_tasks(path)
    return [parse_task(t) for t in tasks] if kind == "osworld" else tasks


@_timed
def task_files(n: int, seed: int) -> Tally:
    """Mutated task files (bytes and structure) through the loaders: tasks, or a TaskError naming the file."""
    from envs.api import TaskError

    tally = Tally("task loaders")
    rng = random.Random(seed)
    sources = _task_sources()
    tally.notes["source_files"] = len(sources)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            kind, data = rng.choice(sources)
            path = pathlib.Path(tmp) / f"case-{i}.json"
            if rng.random() < 0.5:
                path.write_text(json.dumps(mutate_json(data, rng)))
            else:
                raw, _ = damage_bytes(json.dumps(data).encode(), rng)
                path.write_bytes(raw if rng.random() < 0.7 else raw.replace(b"{", b"[" * 5000 + b"{", 1))
            tally.inputs += 1
            try:
                _load_task_file(kind, path)
                tally.accepted += 1
            except TaskError as e:
                if path.name in str(e):
                    tally.refused += 1
                else:
                    tally.escaped.append(f"{kind}: TaskError not naming the file: {str(e)[:120]}")
            except Exception as e:  # noqa: BLE001
                tally.escaped.append(f"{kind}: {type(e).__name__}: {str(e)[:120]}")
            path.unlink()
    return tally


# ------------------------------------------------------------------------------------------ store
def _trajectories(count: int, seed: int) -> list[Any]:
    from guijax.rollout.trajectory import Step, Trajectory

    rs = np.random.RandomState(seed)
    out = []
    for k in range(count):
        steps = [Step(screenshot=rs.randint(0, 256, (28, 28, 3), dtype=np.uint8), response=f"Action: wait() {k}.{i}",
                      response_tokens=rs.randint(0, 1000, 4).astype(np.int32),
                      behaviour_logprobs=-rs.rand(4).astype(np.float32)) for i in range(2)]
        out.append(Trajectory(f"task-{seed}-{k}", "do it", steps, reward=float(rs.rand()), meta={"k": k}))
    return out


def _same_trajectory(a: Any, b: Any) -> bool:
    if (a.task_id, a.reward, a.meta, len(a.steps)) != (b.task_id, b.reward, b.meta, len(b.steps)):
        return False
    return all(np.array_equal(x.screenshot, y.screenshot) and x.response == y.response
               and np.array_equal(x.response_tokens, y.response_tokens)
               and np.array_equal(x.behaviour_logprobs, y.behaviour_logprobs) for x, y in zip(a.steps, b.steps))


@_timed
def store(n: int, seed: int) -> Tally:
    """Damaged copies of a three-shard store, every saved (shard, record) reference read back: the exact
    trajectory, or a StoreError naming the damaged shard. A deleted shard counts as damage too."""
    from guijax.data.store import StoreError, TrajectoryStore

    tally = Tally("trajectory store")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        clean = pathlib.Path(tmp) / "clean"
        written = {}
        writer = TrajectoryStore(clean)
        for s in range(3):
            trajs = _trajectories(3, seed=s)
            shard = writer.append(trajs).name
            written.update({(shard, r): t for r, t in enumerate(trajs)})
        kinds: dict[str, int] = {}
        for i in range(n):
            copy = pathlib.Path(tmp) / f"copy-{i}"
            victim, kind = damaged_copy(clean, copy, lambda d: list(d.glob("*.array_record")), rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            tally.inputs += 1
            tally.faults += 1
            outcome = "accepted"
            for (shard, record), expected in written.items():
                try:
                    got = TrajectoryStore(copy).at(shard, record)
                except StoreError as e:  # opening refuses a store with any damaged shard, naming that one
                    if victim.name not in str(e):
                        tally.escaped.append(f"{kind}: StoreError not naming {victim.name}: {str(e)[:100]}")
                    outcome = "refused"
                    continue
                except Exception as e:  # noqa: BLE001
                    tally.escaped.append(f"{kind} of {victim.name}: {type(e).__name__}: {str(e)[:100]}")
                    outcome = "escaped"
                    continue
                if not _same_trajectory(got, expected):
                    tally.lost.append(f"{kind} of {victim.name}: {shard}:{record} read back different data")
            tally.accepted += outcome == "accepted"
            tally.refused += outcome == "refused"
            shutil.rmtree(copy)
        tally.notes["damage_kinds"] = kinds
    return tally


# ------------------------------------------------------------------------------------------ checkpoints
@_timed
def checkpoints(n: int, seed: int) -> Tally:
    """Damaged copies of a three-step checkpoint directory (one file of the newest step damaged or deleted):
    restore_latest must return some step's exact weights and JSON item, or nothing, and never raise."""
    from absl import logging

    from guijax.checkpoint import Checkpointer

    logging.set_verbosity(logging.ERROR)  # each set-aside step logs a warning
    tally = Tally("checkpoints")
    rng = random.Random(seed)
    saved = {s: ({"w": np.random.RandomState(s).standard_normal((64, 64)).astype(np.float32),
                  "b": np.arange(8, dtype=np.int32) * s}, {"iteration": s, "rng": [s, 7 * s]}) for s in (1, 2, 3)}
    template = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(8, np.int32)}
    fell_back = 0
    with tempfile.TemporaryDirectory() as tmp:
        clean = pathlib.Path(tmp) / "clean"
        ckpt = Checkpointer(clean, keep=5, async_save=False)
        for step, (state, meta) in saved.items():
            ckpt.save(step, state, meta)
        ckpt.close()
        for i in range(n):
            copy = pathlib.Path(tmp) / f"copy-{i}"
            victim, kind = damaged_copy(clean, copy, lambda d: [p for p in (d / "3").rglob("*") if p.is_file()], rng)
            tally.inputs += 1
            tally.faults += 1
            where = f"{kind} of {victim.relative_to(copy)}"
            try:
                ckpt = Checkpointer(copy, keep=5, async_save=False)
                out = ckpt.restore_latest(template, lambda s, m: ({k: np.asarray(v) for k, v in s.items()}, m))
                ckpt.close()
            except Exception as e:  # noqa: BLE001
                tally.escaped.append(f"{where}: {type(e).__name__}: {str(e)[:100]}")
                continue
            if out is None:
                tally.lost.append(f"{where}: no step restored although steps 1 and 2 were intact")
                continue
            step, (state, meta) = out
            want_state, want_meta = saved[step]
            if not all(np.array_equal(state[k], want_state[k]) for k in want_state) or meta != want_meta:
                tally.lost.append(f"{where}: step {step} restored with different contents")
            elif step == 3:
                tally.accepted += 1
            else:
                tally.refused += 1
                fell_back += step < 3
            shutil.rmtree(copy)
    tally.notes["fell_back_to_an_earlier_step"] = fell_back
    return tally


# ------------------------------------------------------------------------------------------ pool
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # the pool already replaced it
        pass


@_timed
def pool(faults: int, seed: int, workers: int = 3, timeout_s: float = 2.0) -> Tally:
    """Episodes on a desk pool while workers are killed (SIGKILL) or hung (SIGSTOP) before or during calls.
    Every call must answer every slot within its deadline; a hit slot's next failure is the fault surfacing
    (refused); a failure on a slot that was not hit is a lost episode, as is a worker that outlives the pool."""
    from envs.actions.model import Action, ActionType
    from envs.pool import DeskFactory, EnvPool
    from envs.tasks import generate_desk_tasks

    tally = Tally("environment pool")
    rng = random.Random(seed)
    tasks = generate_desk_tasks(workers, seed=seed)
    seen: set[int] = set()
    kinds: dict[str, int] = {}
    hit: set[int] = set()  # slots whose worker was hit and whose failure has not been seen yet
    slow_calls = 0

    def settle(call: str, asked: list[int], out: dict) -> set[int]:
        """Sort one call's answers (an input per slot asked); returns the slots that need a new episode."""
        tally.inputs += len(asked)
        if set(out) != set(asked):
            tally.lost.append(f"{call} answered slots {sorted(out)} of {sorted(asked)}")
        again = set()
        for slot, result in out.items():
            if result.ok:
                tally.accepted += 1
                if call == "step" and result.value.done:
                    again.add(slot)
            elif slot in hit:
                hit.discard(slot)
                tally.refused += 1
                again.add(slot)
            else:
                tally.lost.append(f"{call} on slot {slot}, which was not hit, failed: {result.error}")
                again.add(slot)
        return again

    with EnvPool(DeskFactory(popups=False), workers, timeout_s=timeout_s) as envs:
        need_reset = set(range(workers))
        while tally.faults < faults or hit:
            seen.update(envs.worker_pids())
            healthy = [s for s in range(workers) if s not in hit]
            if tally.faults < faults and healthy and rng.random() < 0.5:
                victim = rng.choice(healthy)
                kind = rng.choice(["kill", "stop"])
                sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
                threading.Timer(rng.choice([0.0, 0.05, 0.3]), _signal, (envs.worker_pids()[victim], sig)).start()
                hit.add(victim)
                tally.faults += 1
                kinds[kind] = kinds.get(kind, 0) + 1
            start = time.monotonic()
            if need_reset:
                slots = sorted(need_reset)
                need_reset = settle("reset", slots, envs.reset([tasks[s] for s in slots], slots=slots))
            else:
                actions = {s: Action(ActionType.WAIT, amount=0.0) if rng.random() < 0.5
                           else Action(ActionType.CLICK, point=(rng.randrange(100), rng.randrange(100)))
                           for s in range(workers)}
                need_reset = settle("step", list(actions), envs.step(actions))
            slow_calls += time.monotonic() - start > 2 * timeout_s + 5
            time.sleep(0.35)  # a fault timed after the reply lands before the next call
        seen.update(envs.worker_pids())
    time.sleep(0.5)
    orphans = [p for p in seen if _alive(p)]
    if orphans:
        tally.lost.append(f"worker processes {orphans} outlived the pool")
    if slow_calls:
        tally.escaped.append(f"{slow_calls} calls overran their deadline")
    tally.notes.update(fault_kinds=kinds, worker_processes=len(seen), restarts=len(seen) - workers)
    return tally


# ------------------------------------------------------------------------------------------ server
class _Controller:
    """What the load needs of a desktop controller: /platform and /list_directory, nothing executed."""

    def platform(self) -> str:
        return "Linux"

    def list_directory(self, path: str) -> dict:
        return {"name": path, "type": "directory", "children": []}


def _exchange(address: tuple[str, int], payload: bytes, stall_s: float, deadline_s: float) -> int | None:
    """Send `payload` (then wait `stall_s` holding the connection), return the status answered or 0 when the
    server closed without one; None when nothing came back by the deadline (a hung connection)."""
    with socket.create_connection(address, timeout=deadline_s) as sock:
        try:
            sock.sendall(payload)
        except OSError:
            return 0
        if stall_s:
            time.sleep(stall_s)
        try:
            head = sock.recv(64)
        except socket.timeout:
            return None
        except OSError:
            return 0
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0


def _requests(token: str) -> dict[str, tuple[bytes, float, set[int]]]:
    """Each kind of request: its bytes, how long the client then holds the connection, the statuses allowed."""
    auth = f"Authorization: Bearer {token}\r\n"
    body = b'{"path": "~"}'
    json_post = (f"POST /list_directory HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    return {
        "platform": (f"GET /platform HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n".encode(), 0.0,
                     {200, 503}),
        "list_directory": (json_post, 0.0, {200, 503}),
        "no_token_huge_body": (b"POST /list_directory HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000000000"
                               b"\r\nContent-Type: application/json\r\n\r\n" + b"x" * 65536, 0.0, {401, 413, 503, 0}),
        "oversized_body": (f"POST /list_directory HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 99999999\r\n"
                           "Content-Type: application/json\r\n\r\n".encode(), 0.0, {413, 503}),
        "chunked_body": (f"POST /list_directory HTTP/1.1\r\nHost: localhost\r\n{auth}Transfer-Encoding: chunked\r\n"
                         "Content-Type: application/json\r\n\r\n5\r\n{\"pa\r\n".encode(), 0.0, {411, 413, 400, 503}),
        "half_sent_body": (f"POST /list_directory HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 100\r\n"
                           "Content-Type: application/json\r\n\r\n{\"pa".encode(), 0.0, {408, 503, 0}),
        "idle": (b"", 0.0, {408, 503, 0}),
        "cross_site": (f"POST /list_directory HTTP/1.1\r\nHost: localhost\r\n{auth}Origin: http://evil.example\r\n"
                       "Content-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}".encode(), 0.0, {403, 503}),
        "rebinding_host": (f"GET /platform HTTP/1.1\r\nHost: evil.example\r\n{auth}\r\n".encode(), 0.0, {403, 503}),
        "garbage": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(200)) + b"\r\n\r\n", 0.0,
                    {400, 403, 404, 501, 503, 0}),
    }


@_timed
def server(seconds: float, seed: int, clients: int = 24, max_connections: int = 16, idle_timeout_s: float = 1.0,
           max_body_mb: int = 1) -> Tally:
    """Concurrent clients send well-formed, oversized, chunked, half-sent, idle, cross-site and garbage
    requests for `seconds`. Each must be answered with an allowed status (or closed) within the idle timeout
    plus a margin; the server's handler threads stay at most its connection cap, its traced memory bounded."""
    from envs.server import DesktopServer

    tally = Tally("environment server")
    token = "hostile-load-token"
    srv = DesktopServer(("127.0.0.1", 0), _Controller(), token=token, max_connections=max_connections,
                        idle_timeout_s=idle_timeout_s, max_body_bytes=max_body_mb << 20)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    kinds = _requests(token)
    statuses: dict[str, dict[str, int]] = {k: {} for k in kinds}
    lock = threading.Lock()
    peak_connections = 0
    stop = time.monotonic() + seconds
    tracemalloc.start()
    base_traced = tracemalloc.get_traced_memory()[0]

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop:
            kind = rng.choice(list(kinds))
            payload, stall, allowed = kinds[kind]
            try:
                status = _exchange(srv.server_address, payload, stall, deadline_s=idle_timeout_s + 10)
            except OSError as e:  # refused at connect: the listen backlog was full
                status = f"connect {type(e).__name__}"
            with lock:
                tally.inputs += 1
                key = str(status)
                statuses[kind][key] = statuses[kind].get(key, 0) + 1
                if status is None:
                    tally.escaped.append(f"{kind}: no answer within {idle_timeout_s + 10:.0f} s")
                elif status in allowed:
                    tally.accepted += status == 200
                    tally.refused += status != 200
                elif isinstance(status, int):
                    tally.escaped.append(f"{kind}: answered {status}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        # connections holding a slot: a handler thread that released its slot may still be alive a moment
        peak_connections = max(peak_connections, srv.active_connections)
        time.sleep(0.02)
    peak_traced = tracemalloc.get_traced_memory()[1] - base_traced
    tracemalloc.stop()
    srv.shutdown()
    srv.server_close()
    if peak_connections > max_connections:
        tally.lost.append(f"{peak_connections} connections handled at once, above the cap of {max_connections}")
    if peak_traced > 64 << 20:
        tally.lost.append(f"traced memory peaked {peak_traced / 2**20:.0f} MiB above its start")
    tally.notes.update(statuses=statuses, peak_handler_threads=peak_connections, connection_cap=max_connections,
                       peak_traced_mib=round(peak_traced / 2**20, 1), clients=clients)
    return tally


# ------------------------------------------------------------------------------------------ runner
BUDGETS = {
    "smoke": dict(parsers=400, task_files=120, store=20, checkpoints=8, pool=3, server=4.0),
    "full": dict(parsers=100000, task_files=20000, store=2000, checkpoints=500, pool=40, server=60.0),
}
CAMPAIGNS = {"parsers": parsers, "task_files": task_files, "store": store, "checkpoints": checkpoints,
             "pool": pool, "server": server}


def run(budget: str, seed: int, only: list[str] | None = None) -> list[Tally]:
    out = []
    for name, campaign in CAMPAIGNS.items():
        if only and name not in only:
            continue
        tally = campaign(BUDGETS[budget][name], seed)
        print(f"{tally.campaign}: {tally.inputs} inputs, {tally.faults} faults, {tally.accepted} accepted, "
              f"{tally.refused} refused, {len(tally.escaped)} escaped, {len(tally.lost)} lost "
              f"({tally.seconds:.0f} s)", flush=True)
        out.append(tally)
    return out


def markdown(tallies: list[Tally], command: str) -> str:
    lines = [f"`{command}`", "",
             "| campaign | inputs tried | faults injected | accepted intact | refused cleanly | escaped | lost |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for t in tallies:
        lines.append(f"| {t.campaign} | {t.inputs} | {t.faults} | {t.accepted} | {t.refused} | {len(t.escaped)} "
                     f"| {len(t.lost)} |")
    total = lambda f: sum(f(t) for t in tallies)  # noqa: E731
    lines.append(f"| **all** | {total(lambda t: t.inputs)} | {total(lambda t: t.faults)} | "
                 f"{total(lambda t: t.accepted)} | {total(lambda t: t.refused)} | {total(lambda t: len(t.escaped))} "
                 f"| {total(lambda t: len(t.lost))} |")
    for t in tallies:
        for what in ("escaped", "lost"):
            for example in getattr(t, what)[:5]:
                lines.append(f"- {t.campaign}, {what}: {example}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[Tally]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="smoke")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated campaigns (default: all)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    tallies = run(args.budget, args.seed, [c for c in args.only.split(",") if c] or None)
    command = command_line("hostile.py", argv)
    payload = {"command": command, "budget": args.budget, "seed": args.seed, "machine": machine_info(),
               "campaigns": [t.summary() for t in tallies]}
    write_outputs(args.json, args.markdown, payload, markdown(tallies, command))
    return tallies


if __name__ == "__main__":
    failed = [t for t in main() if t.escaped or t.lost]
    sys.exit(1 if failed else 0)
