"""Synthetic-desk throughput: environment steps per second on one core, rendering included.

    python benchmarks/desk_speed.py [--steps 5000] [--json PATH]

Each step applies a random click / type / scroll / key action and renders the new screenshot (every step
changes the scene, so the renderer's cache never hides the drawing cost) plus the accessibility tree.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from envs.actions.model import Action, ActionType
from envs.desk import DEFAULT_SIZE, DeskEnv
from envs.tasks import generate_desk_tasks


def measure(steps: int, seed: int = 0) -> dict:
    """Steps/s of one DeskEnv in this thread (the caller decides the CPU affinity)."""
    tasks = generate_desk_tasks(18, seed=seed)
    env = DeskEnv(DEFAULT_SIZE, step_limit=10**9, seed=seed)
    rng = random.Random(seed)
    h, w = DEFAULT_SIZE
    kinds = [ActionType.CLICK, ActionType.CLICK, ActionType.TYPE, ActionType.SCROLL, ActionType.HOTKEY]
    env.reset(tasks[0])
    start = time.perf_counter()
    for i in range(steps):
        if i % 15 == 0:
            env.reset(tasks[(i // 15) % len(tasks)])
        kind = rng.choice(kinds)
        point = (rng.randrange(w), rng.randrange(h))
        action = {ActionType.CLICK: Action(kind, point=point), ActionType.TYPE: Action(kind, text="abc"),
                  ActionType.SCROLL: Action(kind, point=point, direction="down", amount=1.0),
                  ActionType.HOTKEY: Action(kind, keys=("tab",))}[kind]
        env.step(action)
    elapsed = time.perf_counter() - start
    return {"steps": steps, "seconds": elapsed, "steps_per_second_per_core": steps / elapsed,
            "screen": list(DEFAULT_SIZE)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}) if hasattr(os, "sched_setaffinity") else None
    result = measure(args.steps)
    elapsed = result["seconds"]
    print(f"synthetic desk {DEFAULT_SIZE[1]}x{DEFAULT_SIZE[0]}: {result['steps_per_second_per_core']:.0f} steps/s on one core "
          f"({args.steps} steps in {elapsed:.2f}s, rendering + a11y tree included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
