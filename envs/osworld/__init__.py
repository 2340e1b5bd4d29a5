"""OSWorld tasks: typed loading, setup steps, getters, metrics, the task runner env, and coverage."""
from envs.osworld.loader import Evaluator, Getter, OSWorldTask, Step, load_osworld, load_split, parse_task

__all__ = ["Evaluator", "Getter", "OSWorldTask", "Step", "load_osworld", "load_split", "parse_task"]
