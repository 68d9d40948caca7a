"""Configs as dataclasses, the generic part: fields that carry their help text and range check
(`doc`, `rule`), building a dataclass tree from a mapping with unknown keys refused by name
(`build`), the range checks (`validate`), `a.b=value` overrides, and YAML files read with every way
they can be wrong as one line (`read_yaml`). The schema itself is `ppokit.config.schema`."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from ppokit.errors import UserError


def decode_utf8(raw: bytes, path: str | Path) -> str:
    """File bytes -> text, or a UserError naming the file and the line of the first byte that is not
    UTF-8. A leading byte-order mark is dropped (it would otherwise end up in the first key or column name)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


def doc(default: Any = None, help: str = "", *, factory: Any = None, check: Any = None, resume: Any = False, if_wrong: str = ""):
    """A dataclass field with its help text and an optional range check `check(value) -> bool`.

    if_wrong: said after the error of a value of the wrong type (e.g. where another tool's spelling of it goes).

    resume: whether a run resumed from a checkpoint may hold another value of the key without
    --resume-force (`resume_rules`): False (the default: any change is refused, as it may change a
    number of the run), True (any change: the key changes no number), or `allowed(before, now) -> bool`.
    """
    metadata = {"help": help, "check": check, "resume": resume, "if_wrong": if_wrong}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def rule(requirement: str, check):
    """A range check that can say what it requires, for the error message."""
    check.requirement = requirement
    return check


def one_of(choices: tuple[str, ...]):
    return rule(f"one of {', '.join(choices)}", lambda v: v in choices)


def resume_rules(cls, prefix: str = "") -> dict[str, Any]:
    """{dotted key: allowed(before, now) -> bool} for every key of `cls` (and its sections) that a resume
    may change (`doc(..., resume=...)`); a key not listed may not change."""
    rules: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            rules.update(resume_rules(inner, f"{prefix}{f.name}."))
            continue
        allowed = f.metadata.get("resume", False)
        if allowed is True:
            rules[prefix + f.name] = lambda before, now: True
        elif callable(allowed):
            rules[prefix + f.name] = allowed
    return rules


def differs_from_default(obj, name: str) -> bool:
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return getattr(obj, name) != default


def unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML / command-line value to the field's type, or raise UserError naming the key."""
    inner, optional = unwrap_optional(tp)
    optional = optional or type(None) in typing.get_args(inner)  # Optional[str | dict]: a union of several kinds and None
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "none", "~")):
        if optional:
            return None
        raise UserError(f"{key}: may not be null")
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping of {inner.__name__} keys, got {value!r}")
        return build(inner, value, prefix=f"{key}.")
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{key}: expected true or false, got {value!r}")
    if inner is int:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise UserError(f"{key}: expected an integer, got {value!r}") from None
    if inner is float:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected a number, got {value!r}")
        try:
            result = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(result):
            raise UserError(f"{key}: must be finite, got {value!r}")
        return result
    if inner is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{key}: expected a string, got {value!r}")
        return str(value)
    origin = typing.get_origin(inner)
    if origin is list:
        (item_tp,) = typing.get_args(inner) or (Any,)
        if not isinstance(value, (list, tuple)):
            return [_coerce(value, item_tp, key)]  # one item written without the list: named as the key itself
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or inner is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if inner is Any:
        return value
    # Unions of several kinds (e.g. str | dict) are taken as given when the value is one of them (their own
    # checks look further); anything else (reward.functions: 7) is refused here, not by the first code to use it.
    kinds = [typing.get_origin(t) or t for t in typing.get_args(inner) if t is not type(None)]
    if kinds and all(isinstance(k, type) for k in kinds) and not isinstance(value, tuple(kinds)):
        names = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise UserError(f"{key}: expected {names}, got {value!r}")
    return value


_KIND_NAMES = {str: "a string", dict: "a mapping", list: "a list", bool: "true/false", int: "an integer", float: "a number"}


def build(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys anywhere in it are one error naming each
    (`unknown_keys`)."""
    unknown = unknown_keys(cls, data, prefix)
    if unknown:
        raise UserError(_unknown_keys_message(unknown, getattr(cls, "OTHER_CONFIGS", ())))
    hints = typing.get_type_hints(cls)
    if_wrong = {f.name: f.metadata.get("if_wrong") for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        try:
            values[key] = _coerce(value, hints[key], f"{prefix}{key}")
        except UserError as e:
            if not if_wrong[key]:
                raise
            raise UserError(f"{e}; {if_wrong[key]}") from None
    return cls(**values)


class UnknownKey(typing.NamedTuple):
    name: Any  # the key as written: kl_coeff
    shown: str  # the key as written, with its section: ppo.kl_coeff
    hint: str  # " (did you mean ...?)" or ""
    section: str  # where it was found: "" for the top level, else "ppo."
    known: tuple[str, ...]  # the keys of that section


def unknown_keys(cls, data: dict, prefix: str = "") -> list[UnknownKey]:
    """Every key of `data` (and of its sections) that `cls` does not have, each with a hint, in order:
    the config's own word for another tool's name (`cls.OTHER_NAMES`: e.g. TRL's flat names; a hint there
    is a text, or a function of the value set that returns one), a key of that name in another section
    (`learning_rate` -> ppo.learning_rate), a close spelling in its own."""
    other_names = getattr(cls, "OTHER_NAMES", {})
    elsewhere = key_paths(cls)
    return _unknown_in(cls, data, prefix,
                       lambda key, value, here, section: _hint(key, value, here, section, prefix, other_names, elsewhere))


def top_level_hint(cls, key: str, value: Any) -> str:
    """The hint that `key` (set to `value`), unknown at the top level of `cls`, gets in `unknown_keys`: " (...)" or ""."""
    return _hint(key, value, tuple(f.name for f in dataclasses.fields(cls)), "", "", getattr(cls, "OTHER_NAMES", {}), key_paths(cls))


def _unknown_in(cls, data: dict, section: str, hint) -> list[UnknownKey]:
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    found = []
    for key, value in data.items():
        if key not in names:
            shown = f"{section}{key}" if isinstance(key, str) and key.strip() else f"{section}{key!r}"
            found.append(UnknownKey(key, shown, hint(key, value, names, section), section, names))
            continue
        inner, _ = unwrap_optional(hints[key])
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            found += _unknown_in(inner, value, f"{section}{key}.", hint)
    return found


def _hint(key, value, here: tuple[str, ...], section: str, prefix: str, other_names: dict, elsewhere: dict) -> str:
    """`key` (set to `value`), unknown among the keys `here` of `section`, in a config whose root is at `prefix`."""
    if isinstance(key, str) and key in other_names:
        said = other_names[key]
        return f" ({said(value) if callable(said) else said})"
    if key in elsewhere:
        return f" (did you mean {' or '.join(prefix + path for path in elsewhere[key])}?)"
    close = difflib.get_close_matches(str(key), here, n=1)
    return f" (did you mean {section}{close[0]}?)" if close else ""


def key_paths(cls, section: str = "") -> dict[str, list[str]]:
    """{key: [its dotted path in every section of `cls` that has it]}."""
    paths: dict[str, list[str]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        paths.setdefault(f.name, []).append(section + f.name)
        inner, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            for key, found in key_paths(inner, f"{section}{f.name}.").items():
                paths.setdefault(key, []).extend(found)
    return paths


class OtherConfig(typing.NamedTuple):
    """Another tool's config, told apart by its names (`cls.OTHER_CONFIGS`): when an unknown key is one of `names`,
    the refusal also says `advice` (e.g. what a TRL GRPO config needs besides its keys' translations)."""

    names: frozenset
    advice: str


def _unknown_keys_message(unknown: list[UnknownKey], other_configs: typing.Sequence[OtherConfig] = ()) -> str:
    """One key: one line, the key with its hint and the known keys of its section. Several: a first line, then one
    key a line with its hint, then the known keys of each section a key without a hint was found in. Then the advice
    of another tool's config whose names are among them, a line each."""
    advice = "".join(f"\n{other.advice}" for other in other_configs
                     if any(isinstance(u.name, str) and u.name in other.names for u in unknown))
    if len(unknown) == 1:
        return f"unknown config key {unknown[0].shown}{unknown[0].hint}; known keys here: {', '.join(unknown[0].known)}{advice}"
    keys = "".join(f"\n  {u.shown}{u.hint}" for u in unknown)
    sections = {u.section: u.known for u in unknown if not u.hint}  # where a key has no hint, the keys it could be
    one_section = len({u.section for u in unknown}) == 1
    known = "".join(f"\nknown keys {'here' if one_section else f'in {s[:-1]}' if s else 'at the top level'}: {', '.join(k)}"
                    for s, k in sections.items())
    return f"unknown config keys:{keys}{known}{advice}"


def validate(obj, prefix: str = "") -> None:
    """Run each field's range check (recursively); raise UserError naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            validate(value, prefix=f"{key}.")
            continue
        check = f.metadata.get("check")
        if check is not None and isinstance(value, str) and not value.strip():
            raise UserError(f"{key}: may not be empty ({f.metadata['help']})")
        if check is not None and value is not None and not check(value):
            requirement = getattr(check, "requirement", None)
            must = f", it must be {requirement}" if requirement else ""
            raise UserError(f"{key}: value {value!r} is out of range{must} ({f.metadata['help']})")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise UserError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"override {text!r}: empty key")
    if any(not part.strip() for part in key.split(".")):
        raise UserError(f"override {text!r}: {key!r} has an empty part; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:
    """A YAML config file -> its top-level mapping; every way a file can be wrong is one UserError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a YAML config file")
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None
    data = parse_yaml_text(decode_text(raw, path), path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys at the top level")
    return data


_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def decode_text(raw: bytes, path: Path) -> str:
    """Bytes of a config file -> text: UTF-8, or UTF-16/32 when a byte-order mark says so (as Windows
    editors save); anything else (a binary file, another encoding) is an error naming the line."""
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            try:
                return raw.decode(encoding)
            except UnicodeDecodeError:
                raise UserError(f"{path}: starts with a {encoding.upper()} byte-order mark but is not {encoding.upper()} text") from None
    if b"\x00" in raw:
        line = raw.count(b"\n", 0, raw.index(b"\x00")) + 1
        raise UserError(f"{path}:{line}: holds NUL bytes: a binary file (or UTF-16 without a byte-order mark), not a YAML config; save it as UTF-8 text")
    return decode_utf8(raw, path)


def parse_yaml_text(text: str, path: Path):
    """YAML text -> data, refusing a key written twice in one mapping (PyYAML keeps the last silently:
    a second `ppo:` section would replace the first one wholesale)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {_one_line(e)}") from None
    if node is None:
        return None
    _refuse_duplicate_keys(node, path, "", set())
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {_one_line(e)}") from None


def _one_line(error: yaml.YAMLError) -> str:
    return " ".join(str(error).split())


def _refuse_duplicate_keys(node, path: Path, prefix: str, seen: set) -> None:
    if id(node) in seen:  # an alias of a node already checked (or a recursive anchor)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{prefix}[{i}]", seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        name = f"{prefix}.{key}" if prefix else str(key)
        if key is not None and key != "<<":
            line = key_node.start_mark.line + 1
            if key in first_line:
                what = "section" if isinstance(value_node, yaml.MappingNode) else "key"
                raise UserError(
                    f"{path}:{line}: {what} {name} is written twice (lines {first_line[key]} and {line}); "
                    "YAML would keep only the second, so merge them into one"
                )
            first_line[key] = line
        _refuse_duplicate_keys(value_node, path, name, seen)


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None):
    """YAML file (optional) + overrides -> validated config of type `cls`."""
    merged = dict(data or {})
    if path is not None:
        merged.update(read_yaml(path))
    for text in overrides or []:
        apply_override(merged, *parse_override(text))
    config = build(cls, merged)
    if hasattr(config, "validate"):
        config.validate()
    else:
        validate(config)
    return config


class ConfigFile:
    """load / to_dict / save for the stage configs (each defines `validate`)."""

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None):
        return load_config(cls, path, overrides, data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
