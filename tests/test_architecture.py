"""docs/architecture.md's map is the code's: every module listed once, every import pointing down the list; the top
level stays small; the import paths users write keep working."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ppokit"
MAP_LINE = re.compile(r"^(\S+\.py|\S+/)\s")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package whose `__init__.py` is empty is no module of its own."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.read_text().strip()}


def map_entry(name: str) -> str:
    """How the map writes a module: its path under src/ppokit/, a package's `__init__.py` as `package/`."""
    path = Path(*name.split(".")[1:])
    if (PACKAGE / path).is_dir():
        return f"{path.as_posix()}/" if name != "ppokit" else "__init__.py"
    return f"{path.as_posix()}.py"


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ppokit modules `name` imports anywhere in its file (lazy imports inside functions too): `from a.b import c`
    is an import of a.b.c where that is a module, else of a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module, or an empty package: the module holding it
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("ppokit"):
                found.add(target)
    return found


def read_map() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The module map", 1)[1].split("```", 2)[1]
    return [m.group(1) for line in block.splitlines() if (m := MAP_LINE.match(line))]


def imports_up_the_map(found: dict[str, Path], listed: list[str]) -> list[tuple[str, str]]:
    """(importer, imported) map entries where the imported module stands above its importer, or on its line."""
    entries = {map_entry(name): name for name in found}
    position = {entries[entry]: i for i, entry in enumerate(listed)}
    return [(map_entry(a), map_entry(b)) for a, path in found.items() for b in sorted(imports(a, path, set(found)))
            if position[b] <= position[a]]


def test_every_module_is_in_the_map_once_and_every_import_points_down_it():
    found = modules()
    listed = read_map()
    entries = {map_entry(name) for name in found}
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({e for e in listed if listed.count(e) > 1})}"
    assert not entries - set(listed), f"modules missing from docs/architecture.md's map: {sorted(entries - set(listed))}"
    assert not set(listed) - entries, f"the map lists what is not a module: {sorted(set(listed) - entries)}"
    upward = imports_up_the_map(found, listed)
    assert not upward, f"imports that point up the map (importer, imported): {upward}"


def test_the_map_check_sees_an_import_up_the_list(tmp_path):
    """The check itself: with the mathematics listed first, every module that imports it imports up the list; a lazy
    import inside a function counts as an import."""
    found, listed = modules(), read_map()
    moved = ["training/algo.py"] + [entry for entry in listed if entry != "training/algo.py"]
    assert ("training/optimise.py", "training/algo.py") in imports_up_the_map(found, moved)
    lazy = tmp_path / "algo.py"
    lazy.write_text("def f():\n    from ppokit.trainer import PPOTrainer\n")
    assert imports("ppokit.training.algo", lazy, set(found)) == {"ppokit.trainer"}


# The packages stand in layers (docs/architecture.md, "Package layers", bottom to top): an import points down the layers
# or stays in its own package. These imports point up, each for its reason; no other may.
IMPORTS_UP_THE_LAYERS = {
    # config/schema.py builds its choices from each package's torch-free declaration table, so that a new engine,
    # strategy, tracker, tool-call format or estimator is one entry in its own package; the tables import
    # config/fields.py at most, never the schema.
    ("ppokit.config.schema", "ppokit.engines"): "ENGINES: each engine's `rollout:` keys",
    ("ppokit.config.schema", "ppokit.process.strategies"): "STRATEGIES: parallel.strategy's choices",
    ("ppokit.config.schema", "ppokit.metrics.trackers"): "TRACKERS: report_to's choices",
    ("ppokit.config.schema", "ppokit.environments.tool_parsers"): "PARSER_NAMES: tool_parser's choices",
    ("ppokit.config.schema", "ppokit.training.estimators"): "ESTIMATORS: ppo.advantage_estimator's choices and traits",
    # models/roles.py decides and builds every role, the reward model's too (the scorer's reward-model sources get the
    # critic's adapter switch); it is set-up code that belongs beside training/parts.py, but
    # `ppokit.models.roles.merge_adapter` is a path users write (docs/memory.md).
    ("ppokit.models.roles", "ppokit.rewards"): "RewardModelReward, RewardScorer",
}
# Modules that stand in a package above some of their importers: they belong in a lower layer (the batch container and
# the mathematics under engines/, models/ and metrics/) and are imported from below until they move.
LOW_MODULES_IN_HIGHER_PACKAGES = {
    "ppokit.training.algo": "the mathematics' one name space: models/forwards.py's logprobs, engines/hf.py's stop tokens",
    "ppokit.training.losses": "the mathematics (pure torch): engines/correction.py's importance weights",
    "ppokit.training.statistics": "the mathematics (pure torch): metrics/values.py's explained variance and pass@k",
    "ppokit.training.token_rewards": "the mathematics (pure torch): metrics/values.py's teacher KL",
    "ppokit.training.episodes": "Episodes, the batch container: engines and the episode loop pack into it, metrics read it",
    "ppokit.training.batching": "micro-batches: rewards/model.py forwards a reward model in them",
}


def layer_of(name: str) -> str:
    """A module's node in the package graph: its package (`training/`), or a top-level module itself (`cli.py`)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def read_layers() -> list[str]:
    """docs/architecture.md's package layers, bottom to top."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("## Package layers", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def imports_up_the_layers(found: dict[str, Path], layers: list[str]) -> set[tuple[str, str]]:
    """(importer, imported) module pairs where the imported module's package stands above its importer's."""
    position = {layer: i for i, layer in enumerate(layers)}
    return {(a, b) for a, path in found.items() for b in imports(a, path, set(found))
            if position[layer_of(b)] > position[layer_of(a)]}


def test_the_packages_are_layered():
    found, layers = modules(), read_layers()
    nodes = {layer_of(name) for name in found}
    assert len(layers) == len(set(layers)), f"listed twice: {sorted({n for n in layers if layers.count(n) > 1})}"
    assert set(layers) == nodes, f"missing from the package layers: {sorted(nodes - set(layers))}; not a package: {sorted(set(layers) - nodes)}"
    up = imports_up_the_layers(found, layers)
    unexplained = sorted(pair for pair in up if pair not in IMPORTS_UP_THE_LAYERS and pair[1] not in LOW_MODULES_IN_HIGHER_PACKAGES)
    assert not unexplained, f"imports that point up the package layers (importer, imported): {unexplained}"
    stale = sorted(set(IMPORTS_UP_THE_LAYERS) - up) + sorted(set(LOW_MODULES_IN_HIGHER_PACKAGES) - {b for _, b in up})
    assert not stale, f"listed as pointing up the layers but no longer do: {stale}"


def test_the_layer_check_sees_an_import_up_the_layers():
    """The check itself: with training/ at the bottom, every package that training/ imports is imported up the layers."""
    found, layers = modules(), read_layers()
    moved = ["training/"] + [layer for layer in layers if layer != "training/"]
    up = imports_up_the_layers(found, moved)
    assert ("ppokit.training.parts", "ppokit.engines") in up and ("ppokit.training.rollout", "ppokit.environments.episode_loop") in up


MATHEMATICS = ("advantages", "losses", "token_rewards", "statistics", "masks", "logprobs")


def test_the_mathematics_imports_only_torch_and_itself():
    """training/'s pure tensor functions (docs/algorithms.md): torch, the standard library's typing, and each other."""
    allowed = {"__future__", "typing", "torch"} | {f"ppokit.training.{name}" for name in MATHEMATICS}
    for name in MATHEMATICS:
        for node in ast.walk(ast.parse((PACKAGE / "training" / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module]
            else:
                continue
            assert all(f in allowed or f.startswith("torch.") for f in found), (name, found)


# ppokit's one HTTP stack is httpx (clients) and starlette on uvicorn (servers): docs/architecture.md says why.
OTHER_HTTP_STACKS = ("requests", "aiohttp", "urllib3", "urllib.request", "urllib.error", "http.client", "http.server", "socketserver")


def http_stacks_imported(path: Path) -> set[str]:
    """The HTTP libraries other than ppokit's one stack that `path` imports anywhere (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {stack for name in names for stack in OTHER_HTTP_STACKS if name == stack or name.startswith(stack + ".")}
    return found


def test_one_http_stack(tmp_path):
    imported = {str(path.relative_to(ROOT)): sorted(found) for path in sorted(PACKAGE.rglob("*.py")) if (found := http_stacks_imported(path))}
    assert not imported, f"other HTTP libraries than httpx, starlette and uvicorn: {imported}"
    lazy = tmp_path / "client.py"  # the check itself
    lazy.write_text("def f():\n    import aiohttp\n    from http import server\n    from urllib.request import urlopen\n")
    assert http_stacks_imported(lazy) == {"aiohttp", "http.server", "urllib.request"}


def test_the_top_level_keeps_at_most_twelve_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


@pytest.mark.parametrize("statement", [
    "from ppokit import PPOTrainer, PPOConfig, PPOHyperparams, RewardConfig, DataConfig, UserError, __version__",
    "from ppokit.environments import Tools, GuessNumber, run_python",
    "from ppokit.rewards import sentiment, ExactMatch, MathEquivalence, RewardSource, ScoringBatch",
    "from ppokit.trainer import PPOTrainer",
])
def test_the_import_paths_users_write_keep_working(statement):
    subprocess.run([sys.executable, "-c", statement], check=True, timeout=300)


@pytest.mark.parametrize("spec", ["ppokit.environments:Tools", "ppokit.environments:GuessNumber",
                                  "ppokit.environments:run_python", "ppokit.rewards:sentiment"])
def test_the_specs_configs_name_keep_loading(spec):
    from ppokit.user_code import load_attribute

    name, loaded = load_attribute(spec, None, "spec", "object", "module:NAME")
    assert name == spec.rpartition(":")[2] and loaded is not None
