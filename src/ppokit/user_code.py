"""Loading the user's own Python by name: `path/to/file.py:NAME` or `package.module:NAME`.

One loader for every place a config names user code (reward functions, environments, tools), so
they all fail the same way: one line naming the spec and what went wrong. Torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional

from ppokit.errors import UserError


def split_spec(spec: Any, what: str, expected: str) -> tuple[str, str]:
    """'target:name' -> (target, name); a one-line UserError naming `what` and `spec` otherwise."""
    target, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not target.strip() or not name.strip():
        raise UserError(f"{what} {spec!r}: expected {expected}")
    return target, name


def load_attribute(spec: str, base_dir: Optional[Path], what: str, kind: str, expected: str) -> tuple[str, Any]:
    """`path/to/file.py:NAME` or `package.module:NAME` -> (NAME, the object).

    what: how errors name the thing ('reward function', 'environment'); kind: what NAME should be
    ('function', 'class'), for the 'has no ...' line; expected: the accepted forms, for a spec
    without ':'. A relative .py path that does not exist from the working directory is looked up
    under `base_dir` (the config file's folder). The file is executed as a fresh module each call.
    """
    target, name = split_spec(spec, what, expected)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = Path(base_dir) / path
        if not path.is_file():
            raise UserError(f"{what} {spec!r}: file {target} not found")
        module_name = f"ppokit_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look their module up here
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            raise UserError(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"{what} {spec!r}: cannot import module {target}: {e}") from None
        except (Exception, SystemExit) as e:  # a relative name ('.x'), or the module failing as it is imported
            raise UserError(f"{what} {spec!r}: importing module {target} raised {type(e).__name__}: {e}") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise UserError(f"{what} {spec!r}: {target} has no {kind} {name}")
    return name, obj
