"""Checks of file arguments where they enter, before any work: a JSON file to read, a file to write
(its folder exists and is writable); each failure an OSError or ValueError naming the path, and
an argparse type that turns them into a usage error (exit code 2, no traceback)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any


def _err(cls: type[OSError], message: str, path: str) -> OSError:
    """An OSError of class `cls` whose str() is `message` (which names `path`)."""
    return cls(message)


def read_json(path, what: str = "file") -> Any:
    """The parsed JSON of `path`. FileNotFoundError / IsADirectoryError / PermissionError naming the
    path, or ValueError naming it with the line and column of the first error."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise _err(FileNotFoundError, f"{what} {path!r} does not exist", path)
    if os.path.isdir(path):
        raise _err(IsADirectoryError, f"{what} {path!r} is a folder, not a JSON file", path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise _err(type(e), f"{what} {path!r} cannot be read: {e.strerror or e}", path) from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path!r} is not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} {path!r} is not JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


def check_writable(path, what: str = "output file") -> str:
    """`path` as a str, once a file can be written there: its folder exists and is writable and the
    path is not a folder. FileNotFoundError / NotADirectoryError / IsADirectoryError /
    PermissionError naming the path otherwise."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _err(IsADirectoryError, f"{what} {path!r} is a folder", path)
    if not os.path.exists(folder):
        raise _err(FileNotFoundError, f"{what} {path!r}: its folder {folder!r} does not exist", path)
    if not os.path.isdir(folder):
        raise _err(NotADirectoryError, f"{what} {path!r}: {folder!r} is not a folder", path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _err(PermissionError, f"{what} {path!r}: its folder {folder!r} is not writable", path)
    return path


def arg_type(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type=` running `check(text)`: its OSError or ValueError becomes a usage error
    (argparse prints `error: argument --x: <message>` and exits with code 2)."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except (OSError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = getattr(check, "__name__", "path")  # argparse names the type in some errors
    return parse
