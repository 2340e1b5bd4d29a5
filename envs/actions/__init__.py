"""Actions: one typed model (model.py) and four surface grammars onto it (UI-TARS text, Agent S2-style
framework calls, EvoCUA's computer_use tool call, SGCD's pyautogui code)."""
from envs.actions.computer_use import parse_computer_use, render_computer_use
from envs.actions.pyautogui_code import parse_pyautogui, render_code
from envs.actions.model import CONTROL_TYPES, TERMINAL_TYPES, Action, ActionParseError, ActionType
from envs.actions.s2 import S2Action, S2ConversionError, parse_s2, s2_to_actions, s2_to_uitars_text
from envs.actions.resize import smart_resize
from envs.actions.uitars import parse_thought, parse_uitars, render_uitars, to_pyautogui

__all__ = ["Action", "ActionParseError", "ActionType", "CONTROL_TYPES", "TERMINAL_TYPES", "S2Action",
           "S2ConversionError", "parse_computer_use", "parse_pyautogui", "parse_s2", "parse_thought", "parse_uitars",
           "render_code", "render_computer_use", "render_uitars", "s2_to_actions", "s2_to_uitars_text", "smart_resize",
           "to_pyautogui"]
