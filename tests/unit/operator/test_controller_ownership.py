"""One owner for each piece of a record: every field of `AdapterRecord` and `PodRecord` names, in
its metadata, the module of the one actor that writes it (the actors table of the controller's
docstring and docs/architecture.md), and this test parses every module of the controller package
and finds each place that writes one.

A write is an assignment (plain, augmented, annotated, by item, `del`) whose target reaches a
field, or a call of a mutating method on it: a container's (`pop`, `clear`, `update`, ...), an
event's or a task's (`set`, `cancel`), or a method of the record's own classes that assigns an
attribute of `self` (`StagingState.failed`). A field is reached through an attribute chain
(`rec.staging.state.attempts`, `self.cache.adapters[k].rolling.taken`), through a local name bound
to such a chain (`written = rec.status`, tuples too), or through a parameter annotated with a
sub-record's class (`entries: Entries`). An attribute of an actor itself (`self.wake`) is the
actor's own, not a record's. What it cannot see: a sub-record's dict passed on inside another
value (the pod workers' `Found` tuples) and `setattr`; those stay in the owner's module by review.

The cache's own dicts of records (`cache.adapters`, `cache.pods`) count as the cache's fields:
only records.py adds and drops records.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from pathlib import Path

import pytest
from lora_operator import controller
from lora_operator.controller import records

PACKAGE = Path(controller.__file__).parent
RECORDS = (records.AdapterRecord, records.PodRecord)
CACHE_DICTS = {"adapters": "cache.adapters", "pods": "cache.pods"}

# Methods that change the object they are called on: containers', an asyncio.Event's (`set`,
# `clear`), a task's or a timer's (`cancel`). The records' own classes add theirs (`_methods`).
MUTATORS = {
    "add",
    "append",
    "cancel",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "set",
    "setdefault",
    "update",
}


@dataclasses.dataclass(frozen=True)
class Write:
    module: str
    line: int
    field: str
    how: str

    def __str__(self) -> str:
        return f"{self.module}.py:{self.line} {self.how} {self.field}"


def owners() -> dict[str, str]:
    """Field name -> the module that owns it, from the records' metadata. A name both records
    use (`info`, `entries`) has one owner, so that a write can be judged by its name."""
    out = {dotted: "records" for dotted in CACHE_DICTS.values()}
    for cls in RECORDS:
        for f in dataclasses.fields(cls):
            owner = f.metadata.get("owner")
            assert owner, f"{cls.__name__}.{f.name} names no owner in its metadata"
            assert (PACKAGE / f"{owner}.py").is_file(), f"{cls.__name__}.{f.name}: no {owner}.py"
            assert out.setdefault(f.name, owner) == owner, f"two owners for `{f.name}`"
    return out


def _mutable_parts() -> dict[type, str]:
    """The mutable classes a record's fields hold (its sub-records and what they hold, such as
    `StagingState`), each with the field it belongs to."""
    found: dict[type, str] = {}

    def visit(hint: object, field: str) -> None:
        for arg in typing.get_args(hint):
            visit(arg, field)
        if (
            isinstance(hint, type)
            and dataclasses.is_dataclass(hint)
            and hint not in RECORDS
            and not hint.__dataclass_params__.frozen  # type: ignore[attr-defined]
            and hint not in found
        ):
            found[hint] = field
            for name, inner in typing.get_type_hints(hint).items():
                del name
                visit(inner, field)

    for cls in RECORDS:
        for name, hint in typing.get_type_hints(cls).items():
            visit(hint, name)
    return found


def _methods(classes: typing.Iterable[type]) -> set[str]:
    """The methods of `classes` that assign an attribute of `self`."""
    out = set()
    for cls in classes:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(t, ast.Attribute) and _root(t) == "self"
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for t in _targets(sub)
            ):
                out.add(node.name)
    return out


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        raw = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        raw = [node.target]
    elif isinstance(node, ast.Delete):
        raw = list(node.targets)
    else:
        return []
    out: list[ast.expr] = []
    while raw:
        t = raw.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            raw.extend(t.elts)
        elif isinstance(t, ast.Starred):
            raw.append(t.value)
        else:
            out.append(t)
    return out


class Scanner:
    def __init__(self, fields: set[str], parts: dict[str, str], methods: set[str]) -> None:
        self.fields, self.parts, self.methods = fields, parts, methods

    def field_of(self, node: ast.expr, aliases: dict[str, str]) -> str | None:
        """The field `node` reaches, the one nearest its root: `rec.staging.task` is the
        stager's `staging`, whatever `task` is called elsewhere."""
        chain: list[ast.Attribute] = []
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Attribute):
                chain.append(node)
            node = node.func if isinstance(node, ast.Call) else node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            return aliases[node.id]
        for attr in reversed(chain):
            value = attr.value
            if isinstance(value, ast.Name) and value.id == "self":
                continue  # the actor's own attribute
            if attr.attr in self.fields:
                return attr.attr
        return None

    @staticmethod
    def cache_dict(node: ast.expr) -> str | None:
        """`cache.adapters` or `cache.pods` when `node` is that dict or an item of it (a
        record added or dropped; what is done to a record itself is its fields' business)."""
        if isinstance(node, ast.Subscript):
            node = node.value
        if (
            isinstance(node, ast.Attribute)
            and node.attr in CACHE_DICTS
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cache"
        ):
            return CACHE_DICTS[node.attr]
        return None

    def aliases(self, func: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
        """The names in `func` (and the functions it holds) that stand for a field: bound to a
        chain that reaches one, or a parameter annotated with a sub-record's class."""
        out: dict[str, str] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.arg) and node.annotation is not None:
                for sub in ast.walk(node.annotation):
                    name = sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)
                    if name in self.parts:
                        out[node.arg] = self.parts[name]
        pairs: list[tuple[ast.expr, ast.expr]] = []
        for node in ast.walk(func):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Tuple)
                        and isinstance(node.value, ast.Tuple)
                        and len(target.elts) == len(node.value.elts)
                    ):
                        pairs.extend(zip(target.elts, node.value.elts, strict=True))
                    else:
                        pairs.append((target, node.value))
            elif isinstance(node, ast.NamedExpr):
                pairs.append((node.target, node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                pairs.append((node.target, node.iter))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs.append((node.optional_vars, node.context_expr))
        for _ in range(len(pairs) + 1):  # an alias of an alias, in any order
            for target, value in pairs:
                if isinstance(target, ast.Name) and target.id not in out:
                    field = self.field_of(value, out)
                    if field is not None:
                        out[target.id] = field
        return out

    def writes(self, module: str, source: str) -> list[Write]:
        tree = ast.parse(source)
        found: list[Write] = []
        for func in _outermost_functions(tree):
            aliases = self.aliases(func)
            for node in ast.walk(func):
                if isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                how = {
                    ast.Assign: "assigns",
                    ast.AugAssign: "assigns",
                    ast.AnnAssign: "assigns",
                    ast.Delete: "deletes",
                }.get(type(node))
                if how is not None:
                    assert isinstance(node, ast.stmt)
                    for t in _targets(node):
                        if isinstance(t, ast.Name):
                            continue  # a name rebound, not a field written
                        field = self.field_of(t, aliases) or self.cache_dict(t)
                        if field is not None:
                            found.append(Write(module, node.lineno, field, how))
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in self.methods
                ):
                    receiver = node.func.value
                    field = self.field_of(receiver, aliases) or self.cache_dict(receiver)
                    if field is not None:
                        found.append(Write(module, node.lineno, field, f".{node.func.attr}() on"))
        return found


def _outermost_functions(
    tree: ast.Module,
) -> typing.Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Module functions and methods (a nested function is scanned with the one holding it)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item


def scanner() -> Scanner:
    parts = _mutable_parts()
    return Scanner(
        set(owners()) - set(CACHE_DICTS.values()),
        {cls.__name__: field for cls, field in parts.items()},
        MUTATORS | _methods(parts),
    )


def scan() -> list[Write]:
    s = scanner()
    return [
        w for path in sorted(PACKAGE.glob("*.py")) for w in s.writes(path.stem, path.read_text())
    ]


def test_each_field_of_a_record_is_written_only_by_its_owner() -> None:
    owner = owners()
    found = scan()
    wrong = [f"{w} (the {owner[w.field]}'s)" for w in found if owner[w.field] != w.module]
    assert not wrong, "a record's field written outside its owner:\n" + "\n".join(wrong)
    # The scan sees the writes it checks: each owner is found writing each of its fields.
    unseen = {f for f in owner if not any(w.field == f for w in found)}
    unseen -= set(CACHE_DICTS.values())  # the cache writes them as `self.adapters`, `self.pods`
    assert not unseen, f"no write found of {sorted(unseen)}: does the scan still see them?"


def test_the_owners_are_the_actors_of_the_table() -> None:
    """The package docstring's actors table names each owner module."""
    table = controller.__doc__ or ""
    for module in set(owners().values()):
        assert f"| {module} |" in table, module


BAD = {
    "attribute": ("rec.entries.canary = {}", "entries"),
    "augmented": ("rec.staging.state.attempts += 1", "staging"),
    "item": ("rec.entries.own[p] = entry", "entries"),
    "del": ("del self.cache.adapters[k].entries.own[p]", "entries"),
    "pop": ("rec.entries.own.pop(p, None)", "entries"),
    "clear": ("prec.entries.clear()", "entries"),
    "update": ("rec.entries.own.update(x)", "entries"),
    "cancel": ("rec.staging.task.cancel()", "staging"),
    "event": ("prec.wake.set()", "wake"),
    "record method": ("rec.staging.state.failed(permanent=True)", "staging"),
    "through a call": ("self.cache.adapters.get(k).rolling.taken = c", "rolling"),
    "alias": ("written = rec.status\nwritten.now = None", "status"),
    "tuple alias": ("info, rolling = rec.info, rec.rolling\nrolling.taking = True", "rolling"),
    "alias of alias": ("s = rec.staging\nstate = s.state\nstate.attempts = 0", "staging"),
    "walrus": ("if (t := rec.staging.task) is not None:\n    t.cancel()", "staging"),
    "loop": ("for e in rec.entries.own.values():\n    e.x = 1", "entries"),
    "closure": ("state = rec.staging.state\ndef f():\n    state.bytes_so_far = 1", "staging"),
    "a record from the cache": (
        "for prec in self.cache.pods.values():\n    prec.task = None",
        "task",
    ),
    "cache's dict": ("self.cache.pods.pop(key, None)", "cache.pods"),
    "cache's dict, item": ("self.cache.adapters[key] = rec", "cache.adapters"),
}


@pytest.mark.parametrize(("code", "field"), list(BAD.values()), ids=list(BAD))
def test_the_scan_finds_each_kind_of_write(code: str, field: str) -> None:
    source = "def f(self, rec, prec, k, p, entry, x, c, key):\n" + textwrap.indent(code, "    ")
    assert [w.field for w in scanner().writes("m", source)] == [field]


def test_the_scan_finds_a_parameter_annotated_with_a_sub_record() -> None:
    source = "def _new_canary(entries: Entries) -> None:\n    entries.canary = {}\n"
    assert [w.field for w in scanner().writes("m", source)] == ["entries"]


GOOD = {
    "the actor's own": "self.wake.clear()\nself._due.pop(k)\nself.info = 1",
    "a read": "x = rec.entries.own.get(p)\ny = rec.staging.task\nrec.staging.task.done()",
    "a name rebound": "entries = {}\nentries[p] = 1",
    "a seam": "self.seams.active.clear()",
}


@pytest.mark.parametrize("code", list(GOOD.values()), ids=list(GOOD))
def test_the_scan_leaves_what_writes_no_record(code: str) -> None:
    source = "def f(self, rec, k, p):\n" + textwrap.indent(code, "    ")
    assert scanner().writes("m", source) == []
