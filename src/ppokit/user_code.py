"""Loading the user's own Python by name: `path/to/file.py:NAME` or `package.module:NAME`.

One loader for every place a config names user code (reward functions, environments, tools), so
they all fail the same way: one line naming the spec and what went wrong. Torch-free.

A file's folder is first on the import path while the file loads, so that it imports its neighbours (`env.py`'s
`import rewards` finds the `rewards.py` beside it), as `python env.py` would. Imports are cached by name, one module
per name in a process: a neighbour whose name is already imported from elsewhere (a module of the standard library or
an installed package, or a neighbour of another file under the same name) would silently be that other module, so
the file is refused, in one line naming the neighbour to rename.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
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
        folder = str(path.resolve().parent)
        with _IMPORT_PATH_LOCK:
            shadowed = _imported_elsewhere(folder)
            sys.path.insert(0, folder)  # its neighbours import, while it loads
            try:
                module_spec.loader.exec_module(module)
            except (Exception, SystemExit) as e:
                raise UserError(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
            finally:
                if folder in sys.path:  # unless the file took it off itself
                    sys.path.remove(folder)
        _refuse_shadowed(module, shadowed, what, spec, path)
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


_IMPORT_PATH_LOCK = threading.RLock()  # one file's folder on sys.path at a time (a file may load another)


def _imported_elsewhere(folder: str) -> dict[str, Any]:
    """The modules beside `folder`'s files (NAME.py, NAME/) already imported under their name from somewhere else."""
    found = {}
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # a folder it cannot list: Python's own import fails the same way, or not
        return found
    for entry in entries:
        name = entry.stem if entry.suffix == ".py" else entry.name if (entry / "__init__.py").is_file() else None
        module = sys.modules.get(name) if name and name.isidentifier() else None
        where = getattr(module, "__file__", None)
        if module is not None and (where is None or Path(where).resolve().parent not in (Path(folder), Path(folder) / name)):
            found[name] = module
    return found


def _refuse_shadowed(module, shadowed: dict[str, Any], what: str, spec: str, path: Path) -> None:
    """A file that uses a module by a name its folder has a file for, when that name was imported from elsewhere before:
    the import gave it the other module (`import NAME` binds it; `from NAME import x` binds what NAME defines)."""
    for name, other in shadowed.items():
        used = any(value is other or getattr(value, "__module__", None) == name for value in vars(module).values())
        if used:
            raise UserError(f"{what} {spec!r}: {path} imports {name}, which is already imported from "
                            f"{getattr(other, '__file__', None) or 'the interpreter'} (a module of that name was imported "
                            f"first; Python imports one module per name), not the {name} beside it; rename {path.parent / name}")
