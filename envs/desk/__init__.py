"""The synthetic desk: a procedurally generated, Pillow-rendered desktop with verifiable tasks and a
scripted expert; the embedded default environment of the CPU recipes."""
from envs.desk.env import DEFAULT_SIZE, DeskEnv
from envs.desk.expert import ExpertTrace, ScriptedExpert, run_expert
from envs.desk.families import FAMILIES

__all__ = ["DEFAULT_SIZE", "DeskEnv", "ExpertTrace", "FAMILIES", "ScriptedExpert", "run_expert"]
