"""OSWorld metric functions, registered in envs.metrics under OSWorld's names.

Each takes the result getter's value, then the expected getter's value (when the task has one), then the
task's `options`, and returns a float in [0, 1]. A missing result (None: file absent, command failed) scores 0.
Written from OSWorld's documented behaviour; only the metrics listed in `__all__` exist here.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from envs.metrics import register_metric

__all__ = ["exact_match", "check_include_exclude", "infeasible", "check_direct_json_object", "compare_text_file",
           "compare_table", "check_moved_jpgs", "literal_match", "is_in_list", "file_contains", "compare_csv",
           "check_list"]


@register_metric("exact_match")
def exact_match(result: Any, rules: dict[str, Any], **_: Any) -> float:
    return float(result == rules["expected"])


@register_metric("check_include_exclude")
def check_include_exclude(result: Any, rules: dict[str, Any], **_: Any) -> float:
    if result is None:
        return 0.0
    include, exclude = rules.get("include", []), rules.get("exclude", [])
    return float(all(s in result for s in include) and all(s not in result for s in exclude))


@register_metric("infeasible")
def infeasible(*_: Any, **__: Any) -> float:
    """Never called on state: an infeasible task scores 1 only when the agent's last action is FAIL, which
    the environment decides (see OSWorldEnv.evaluate)."""
    return 0.0


@register_metric("check_direct_json_object")
def check_direct_json_object(result: Any, rules: dict[str, Any], **_: Any) -> float:
    """`result` is a JSON object (or its text, single quotes allowed). Without `expect_in_result` every
    expected key must be equal (lists compared sorted when `ignore_list_order`); with it, an expected list
    passes when one of its items is in the result's list, and an expected string when it is a substring."""
    if result is None:
        return 0.0
    if isinstance(result, str):
        try:
            result = json.loads(result.strip().replace("'", '"'))
        except json.JSONDecodeError:
            return 0.0
    if not isinstance(result, dict):
        return 0.0
    expected = rules["expected"]
    if not rules.get("expect_in_result", False):
        for key, want in expected.items():
            got = result.get(key)
            if expected.get("ignore_list_order", False) and isinstance(want, list) and isinstance(got, list):
                try:
                    if sorted(want) != sorted(got):
                        return 0.0
                except TypeError:
                    return 0.0
            elif want != got:
                return 0.0
        return 1.0
    for key, want in expected.items():
        got = result.get(key)
        if isinstance(want, list):
            if not (isinstance(got, list) and any(w in got for w in want)):
                return 0.0
        elif isinstance(want, str):
            if not isinstance(got, str) or want not in got:
                return 0.0
        elif want != got:
            return 0.0
    return 1.0


def _read_text(path: str | None) -> str | None:
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@register_metric("compare_text_file")
def compare_text_file(result: str | None, expected: str | None, ignore_blanks: bool = False,
                      ignore_case: bool = False, **_: Any) -> float:
    a, b = _read_text(result), _read_text(expected)
    if a is None or b is None:
        return 0.0
    if ignore_blanks:
        a, b = (re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", t)).strip() for t in (a, b))
    if ignore_case:
        a, b = a.lower(), b.lower()
    return float(a == b)


@register_metric("compare_csv")
def compare_csv(result: str | None, expected: str | None, strict: bool = True, ignore_case: bool = False, **_: Any) -> float:
    a, b = _read_text(result), _read_text(expected)
    if a is None or b is None:
        return 0.0
    la, lb = a.splitlines(), b.splitlines()
    if not strict:
        la, lb = [x.strip() for x in la], [x.strip() for x in lb]
    if ignore_case:
        la, lb = [x.lower() for x in la], [x.lower() for x in lb]
    return float(la == lb)


@register_metric("file_contains")
def file_contains(result: str | None, rules: dict[str, Any], **_: Any) -> float:
    text = _read_text(result)
    if text is None:
        return 0.0
    return float(all(s in text for s in rules["expected"]))


@register_metric("check_moved_jpgs")
def check_moved_jpgs(directory: dict[str, Any] | None, rules: dict[str, Any], **_: Any) -> float:
    if not directory or "children" not in directory:
        return 0.0
    names = [c["name"] for c in directory["children"]]
    want = rules["expected"]
    return float(len(names) == len(want) and set(names) == set(want))


@register_metric("literal_match")
def literal_match(result: Any, expected: Any, ignore_case: bool = False, type: str = "str", **_: Any) -> float:
    if result is None:
        return 0.0
    if type == "str":
        a, b = str(result), str(expected)
        return float(a.lower() == b.lower() if ignore_case else a == b)
    if type == "list":
        if not isinstance(result, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return 0.0
        a, b = [str(x) for x in result], [str(x) for x in expected]
        if ignore_case:
            a, b = [x.lower() for x in a], [x.lower() for x in b]
        return float(a == b)
    raise ValueError(f"literal_match: unknown type {type!r} (str or list)")


@register_metric("is_in_list")
def is_in_list(result: Any, rules: dict[str, Any], **_: Any) -> float:
    return float(result is not None and rules["expected"] in result)


@register_metric("check_list")
def check_list(result: str | None, rules: dict[str, Any], **_: Any) -> float:
    """Every `expect` regex must match some line of the file and no `unexpect` regex any line."""
    text = _read_text(result)
    if text is None:
        return 0.0
    lines = text.splitlines()
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    if not all(any(p.search(line) for line in lines) for p in expect):
        return 0.0
    return float(not any(p.search(line) for p in unexpect for line in lines))


# -- spreadsheets --------------------------------------------------------------------------------------------
def _load_book(path: str):
    import openpyxl

    return openpyxl.load_workbook(path, data_only=True)


def _sheet_values(ws) -> list[list[Any]]:
    rows = [list(r) for r in ws.iter_rows(values_only=True)]
    while rows and all(v is None for v in rows[-1]):
        rows.pop()
    width = max((max((i + 1 for i, v in enumerate(r) if v is not None), default=0) for r in rows), default=0)
    return [r[:width] + [None] * (width - len(r[:width])) for r in rows]


def _norm(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        return v.strip()
    return v


def _pick_sheet(idx: Any, result_book, expected_book):
    """OSWorld sheet selectors: int (result book by index), 'RI<n>'/'EI<n>' (result/expected by index),
    'RN<name>'/'EN<name>' (by name)."""
    if isinstance(idx, int):
        book, key, by_name = result_book, idx, False
    elif isinstance(idx, str) and len(idx) > 2 and idx[0] in "RE" and idx[1] in "IN":
        book = result_book if idx[0] == "R" else expected_book
        by_name = idx[1] == "N"
        key = idx[2:] if by_name else int(idx[2:])
    else:
        raise ValueError(f"compare_table: bad sheet selector {idx!r}")
    if book is None:
        return None
    if by_name:
        return book[key] if key in book.sheetnames else None
    return book.worksheets[key] if key < len(book.worksheets) else None


def _cell_matches(value: Any, props: dict[str, Any]) -> bool:
    """OSWorld's check_cell props: {'value': {'method': 'eq'|'ne'|'approx:<tol>'|'str_eq'|..., 'ref': x}}."""
    for prop, rule in props.items():
        if prop != "value":
            raise ValueError(f"compare_table check_cell: property {prop!r} is not supported (only 'value')")
        method, ref = rule.get("method", "eq"), rule.get("ref")
        got = _norm(value)
        if method == "eq":
            ok = got == _norm(ref)
        elif method == "ne":
            ok = got != _norm(ref)
        elif method.startswith("approx"):
            tol = float(method.split(":", 1)[1]) if ":" in method else 1e-6
            try:
                ok = abs(float(got) - float(ref)) <= tol
            except (TypeError, ValueError):
                ok = False
        elif method == "str_eq":
            ok = str(got) == str(ref)
        elif method == "str_contains":
            ok = str(ref) in str(got)
        else:
            raise ValueError(f"compare_table check_cell: method {method!r} is not supported")
        if not ok:
            return False
    return True


@register_metric("compare_table")
def compare_table(result: str | None, expected: str | None = None, rules: list[dict[str, Any]] | None = None,
                  **_: Any) -> float:
    """Spreadsheet comparison (openpyxl, cached values). Without `rules`: every sheet of the result equals the
    expected one (same names, same cell values). Rules supported: `sheet_data` (two sheets' values equal),
    `sheet_name` (same sheet names), `check_cell` (a cell's value against a reference). Other rule types
    raise, so a task that needs them is reported rather than mis-scored."""
    if result is None or not os.path.exists(result):
        return 0.0
    try:
        rbook = _load_book(result)
    except Exception:
        return 0.0
    ebook = _load_book(expected) if expected else None
    if not rules:
        if ebook is None:
            raise ValueError("compare_table: no expected file and no rules")
        if rbook.sheetnames != ebook.sheetnames:
            return 0.0
        return float(all(_sheet_values(r) == _sheet_values(e) for r, e in zip(rbook.worksheets, ebook.worksheets)))
    for rule in rules:
        kind = rule.get("type")
        if kind == "sheet_name":
            if ebook is None or rbook.sheetnames != ebook.sheetnames:
                return 0.0
        elif kind == "sheet_data":
            a = _pick_sheet(rule.get("sheet_idx0", 0), rbook, ebook)
            b = _pick_sheet(rule.get("sheet_idx1", "EI0"), rbook, ebook)
            if a is None or b is None:
                return 0.0
            va = [[_norm(v) for v in row] for row in _sheet_values(a)]
            vb = [[_norm(v) for v in row] for row in _sheet_values(b)]
            if va != vb:
                return 0.0
        elif kind == "check_cell":
            ws = _pick_sheet(rule.get("sheet_idx", 0), rbook, ebook)
            if ws is None or not _cell_matches(ws[rule["coordinate"]].value, rule.get("props", {})):
                return 0.0
        else:
            raise ValueError(f"compare_table: rule type {kind!r} is not supported")
    return 1.0
