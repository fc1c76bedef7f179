"""A stage's programs sent once each: units whose programs differ only in the names of their
tensors and in their key/value-cache positions (a deep model's decoder layers) name one program of
a table by its digest, with those names and positions beside it (issue #60).

`tabled` (the driver) writes a SETUP's entries so; `untabled` (the worker) checks each program of
the table (`lightning_remote_mp.model.program.load_program`, which also keeps it checked for the units
that follow), checks it against its digest, and writes each entry's programs back whole. The digest
is of the program's content with its names numbered (`program.program_key`): what a worker checks,
whatever names the driver chose.

>>> program = {"inputs": ["x"], "tensors": {"w": "fc_weight"}, "outputs": ["y"],
...            "steps": [["y", ["aten", "linear", "default"], [{"ref": "x"}, {"ref": "w"}], {}]]}
>>> other = {**program, "tensors": {"w": "fc2_weight"}}
>>> entries = [{"layer": LAYER_PATH, "kwargs": {"programs": {"train": p}}} for p in (program, other)]
>>> sent, table = tabled(entries)
>>> len(table), sent[1]["kwargs"]["programs"]["train"]["tensors"]
(1, ['fc2_weight'])
>>> untabled(sent, table)[1]["kwargs"]["programs"]["train"]["tensors"]
{'w': 'fc2_weight'}
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model.graph_layer import LAYER_PATH
from lightning_remote_mp.model.program import (
    kv_cache_position,
    kv_cache_positions,
    load_program,
    program_key,
    with_kv_cache_position,
)


def digest(program: Mapping[str, Any]) -> str:
    """The digest a table files ``program`` under: of its content, its names numbered."""
    return hashlib.sha256(program_key(program).encode()).hexdigest()[:32]


def tabled(entries: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``entries`` (`LayerEntry.to_wire`'s) with each traced unit's programs named by digest, and
    the table of the programs they name: ``{digest: program}``."""
    table: dict[str, Any] = {}
    out = []
    for entry in entries:
        programs = entry["kwargs"].get("programs") if entry.get("layer") == LAYER_PATH else None
        if not isinstance(programs, Mapping):
            out.append(dict(entry))
            continue
        named = {}
        for mode, program in programs.items():
            key = digest(program)
            table.setdefault(key, program)
            positions = kv_cache_positions(program)
            named[mode] = {"program": key, "tensors": list(program.get("tensors", {}).values())}
            named[mode] |= {"positions": positions} if positions else {}
        out.append({**entry, "kwargs": {**entry["kwargs"], "programs": named}})
    return out, table


def untabled(entries: Sequence[Any], table: Mapping[str, Any]) -> list[Any]:
    """``entries`` with each program named by digest written out whole from ``table``; `SpecError`
    for a table program that is malformed, refused or not what its digest says, and for a unit that
    names none of them or gives it the wrong number of tensors or positions."""
    for key, program in table.items():
        load_program(program, f"program {key!r:.40} of the table")  # says what is wrong with it, if anything
        if digest(program) != key:
            raise SpecError(f"program {key!r:.40} of the table: its content has another digest")
    out = []
    for i, entry in enumerate(entries):
        programs = entry.get("kwargs", {}).get("programs") if isinstance(entry, Mapping) else None
        if not (isinstance(programs, Mapping) and any(_is_ref(p) for p in programs.values())):
            out.append(entry)
            continue
        whole = {mode: _whole(ref, table, f"entry {i}, {mode} program") for mode, ref in programs.items()}
        out.append({**entry, "kwargs": {**entry["kwargs"], "programs": whole}})
    return out


def _is_ref(value: Any) -> bool:
    return isinstance(value, Mapping) and "program" in value


def _whole(ref: Any, table: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not (_is_ref(ref) and isinstance(ref["program"], str) and ref["program"] in table):
        raise SpecError(f"{where}: names no program of the table")
    program = table[ref["program"]]
    names, positions = ref.get("tensors", []), list(ref.get("positions", []))
    template = program.get("tensors", {})
    if not (isinstance(names, list) and len(names) == len(template) and all(isinstance(n, str) for n in names)):
        raise SpecError(f"{where}: gives {len(names)} tensor names for the program's {len(template)}")
    steps = []
    for step in program["steps"]:
        if kv_cache_position(step) is not None:
            if not positions or type(positions[0]) is not int:
                raise SpecError(f"{where}: gives too few key/value-cache positions, or not numbers")
            step = with_kv_cache_position(step, positions.pop(0))
        steps.append(step)
    if positions:
        raise SpecError(f"{where}: gives {len(positions)} key/value-cache positions too many")
    return {**program, "tensors": dict(zip(template, names)), "steps": steps}
