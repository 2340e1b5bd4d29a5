"""On-policy trajectories whose consecutive steps share screenshot history: what the batch pipeline's
deduplication, response-only and packing tests encode."""
from __future__ import annotations

import numpy as np

from guijax.rollout.trajectory import Source, Step, Trajectory


def trajectories(proc, n: int = 2, steps: int = 4,
                 sizes: tuple[tuple[int, int], ...] = ((56, 56), (56, 84))) -> list[Trajectory]:
    """On-policy trajectories whose consecutive steps share screenshot history (max_images=3); screenshot
    sizes alternate through `sizes`."""
    rs = np.random.RandomState(1)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(n):
        shots = []
        for j in range(steps):
            h, w = sizes[(i + j) % len(sizes)]
            text = f"Thought: step {j}\nAction: click(start_box='({i},{j})')"
            tokens = np.asarray(proc.tokenizer(text, add_special_tokens=False)["input_ids"] + [im_end], np.int32)
            shots.append(Step(rs.randint(0, 256, (h, w, 3), dtype=np.uint8), text, tokens,
                              -rs.rand(len(tokens)).astype(np.float32)))
        out.append(Trajectory(f"task-{i}", f"open the settings panel {i}", shots, source=Source.ON_POLICY))
    return out
