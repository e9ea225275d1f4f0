"""Reading the project's declarative TOML files (pair files, scenario files) with one set of errors."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path


def read_toml(path: str | os.PathLike[str], what: str, error: type[Exception], *, not_found_hint: str = "") -> dict:
    """The parsed table of the TOML file at ``path``.

    Args:
        what: how messages name the file, e.g. ``"pair file"``.
        error: the exception class raised (the caller's own, e.g. ``PairFileError``).
        not_found_hint: appended to the not-found message, e.g. ``" (examples: pairs/*.toml)"``.

    Raises:
        error: the file is missing, unreadable, not UTF-8 text, or not valid TOML (the message names
            the file and the cause).
    """
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} {path} not found{not_found_hint}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} {path} is not valid TOML: {exc}") from None
