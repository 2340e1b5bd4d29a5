"""Agent side of rollouts: prompts with screenshot history, and the engine that drives environments."""
