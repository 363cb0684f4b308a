"""The C interface of the native CPU kernels for ctypes, built from their headers (ABI_HEADERS
and the headers they include, read by kernels/cpu/c_header.py): the argument and return types
of every declared function, ctypes mirrors of the declared structs and the integer constants.
Nothing is written twice, so a function or a struct field added to a header is bound, or
mirrored, at the next load.

`bind` checks a library against them before any call can go wrong: every declared function must
be exported, and each struct's size and each field's offset and size as compiled (abi_layout.c's
table, `wick_abi_layout`) must be the ctypes structure's, field for field both ways. Otherwise
AbiError, and native.py refuses the library (callers fall back to PyTorch as when the build
fails) instead of corrupting memory on a call.

Every pointer is a c_void_p: callers pass tensors' addresses as ints, None for NULL and packed
argument arrays as bytes, which c_void_p converts at the cost of any simple type (the hot path's
calls cost what the hand-written bindings did), where a typed POINTER(c_float) would refuse an
int. `char *` alone is a c_char_p, a C string (wick_isa returns one).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from model_server.kernels.cpu.c_header import (
    CType,
    Declarations,
    Function,
    HeaderError,
    parse_headers,
)

_HERE = Path(__file__).parent
# The headers whose prototypes are the library's entry points.
ABI_HEADERS: tuple[Path, ...] = (
    _HERE / "wick_entry.h",
    _HERE / "wick_mla.h",
    _HERE / "wick_moe.h",
    _HERE / "wick_moe_wna16.h",
    _HERE / "wick_moe_routing.h",
    _HERE / "wick_stack.h",
)
# abi_layout.c's entry point (declared in wick_stack.h).
LAYOUT_ENTRY = "wick_abi_layout"

_SCALARS: dict[str, Any] = {
    "char": ctypes.c_char,
    "signed char": ctypes.c_byte,
    "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "long double": ctypes.c_longdouble,
    "_Bool": ctypes.c_bool,
    "bool": ctypes.c_bool,
    "int8_t": ctypes.c_int8,
    "int16_t": ctypes.c_int16,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8,
    "uint16_t": ctypes.c_uint16,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "ssize_t": ctypes.c_ssize_t,
    "ptrdiff_t": ctypes.c_ssize_t,
    "intptr_t": ctypes.c_ssize_t,
    "uintptr_t": ctypes.c_size_t,
}

Structures = Mapping[str, type[ctypes.Structure]]
# struct -> field ("" for the struct itself) -> (offset, size) in bytes.
Layout = dict[str, dict[str, tuple[int, int]]]


class AbiError(RuntimeError):
    """The library and its Python side disagree (or the headers cannot be read)."""


class BoundLibrary(ctypes.CDLL):
    """A library whose functions, once `bind` ran, are only the declared ones: any other name
    is an AttributeError, never a function ctypes would call with its default conversions (an
    int as a C int: a pointer truncated). Bound functions are plain instance attributes, so
    this costs the calls nothing."""

    _sealed = False

    def __getattr__(self, name: str) -> Any:
        if self._sealed:
            headers = " or ".join(h.name for h in ABI_HEADERS)
            raise AttributeError(f"{name} is not declared in {headers}: declare it to call it")
        return super().__getattr__(name)


@cache
def declarations() -> Declarations:
    """ABI_HEADERS' declarations, read on first use."""
    try:
        return parse_headers(*ABI_HEADERS)
    except HeaderError as exc:
        raise AbiError(f"cannot read the native CPU kernels' headers: {exc}") from exc


@cache
def structures() -> Structures:
    """The ctypes mirrors of the headers' structs, by typedef name."""
    return build_structures(declarations())


def structure(name: str) -> type[ctypes.Structure]:
    """One struct's ctypes mirror."""
    return structures()[name]


def constant(name: str) -> int:
    """An integer constant of the headers (#define or enum)."""
    return declarations().constants[name]


def build_structures(decls: Declarations) -> Structures:
    """ctypes Structures for `decls`' structs, with C's natural alignment (no _pack_), which is
    what the C compiler gives the same members in the same order on the platforms we build."""
    built: dict[str, type[ctypes.Structure]] = {}
    for struct in decls.structs.values():  # declaration order: members' structs come first
        fields = [(f.name, ctypes_type(f.type, built)) for f in struct.fields]
        doc = f"{struct.name} of {struct.header}, mirrored from the header (kernels/cpu/abi.py)."
        built[struct.name] = type(
            struct.name,
            (ctypes.Structure,),
            {"_fields_": fields, "__doc__": doc, "__module__": __name__},
        )
    return built


def ctypes_type(ctype: CType, structs: Structures) -> Any:
    """The ctypes type of a field, parameter or return value (None for void)."""
    if ctype.pointers:
        base = ctypes.c_char_p if ctype.pointers == 1 and ctype.name == "char" else ctypes.c_void_p
    elif ctype.is_struct:
        base = structs[ctype.name]
    elif ctype.name == "void":
        base = None
    else:
        base = _SCALARS[ctype.name]
    for dim in reversed(ctype.dims):
        base = base * dim
    return base


def function_types(function: Function, structs: Structures) -> tuple[list[Any], Any]:
    """(argtypes, restype) of a declared function."""
    argtypes = [ctypes_type(p.type, structs) for p in function.params]
    return argtypes, ctypes_type(function.restype, structs)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every declared function of `lib` given its argument and return types, after checking
    that each exists and that the struct layouts agree (check_layout); AbiError when not."""
    decls, structs = declarations(), structures()
    missing = [f"{f.name} ({f.header})" for f in decls.functions.values() if not _has(lib, f.name)]
    if missing:
        raise AbiError(f"{lib._name} lacks functions its headers declare: {', '.join(missing)}")
    for function in decls.functions.values():
        entry = getattr(lib, function.name)
        entry.argtypes, entry.restype = function_types(function, structs)
    check_layout(lib, structs)
    if isinstance(lib, BoundLibrary):
        lib._sealed = True
    return lib


def _has(lib: ctypes.CDLL, name: str) -> bool:
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


def compiled_layout(lib: ctypes.CDLL) -> Layout:
    """The library's own account of its structs (abi_layout.c)."""
    if not _has(lib, LAYOUT_ENTRY):
        raise AbiError(f"{lib._name} lacks {LAYOUT_ENTRY} (abi_layout.c)")
    entry = getattr(lib, LAYOUT_ENTRY)
    entry.argtypes, entry.restype = function_types(declarations().functions[LAYOUT_ENTRY], {})
    rows = entry(None, None, 0)
    names = (ctypes.c_char_p * (2 * rows))()
    values = (ctypes.c_int64 * (2 * rows))()
    entry(names, values, rows)
    layout: Layout = {}
    for i in range(rows):
        struct, field = (names[2 * i] or b"").decode(), (names[2 * i + 1] or b"").decode()
        layout.setdefault(struct, {})[field] = (values[2 * i], values[2 * i + 1])
    return layout


def ctypes_layout(structs: Structures) -> Layout:
    """The same account of the ctypes mirrors."""
    layout: Layout = {}
    for name, cls in structs.items():
        rows = {"": (0, ctypes.sizeof(cls))}
        for field, _ in cls._fields_:
            descriptor = getattr(cls, field)
            rows[field] = (descriptor.offset, descriptor.size)
        layout[name] = rows
    return layout


def layout_mismatches(compiled: Layout, mirrored: Layout) -> list[str]:
    """Every difference between C's layout and the mirrors', in words."""
    problems: list[str] = []
    for struct in compiled.keys() - mirrored.keys():
        problems.append(f"abi_layout.c lists struct {struct}, which the headers do not declare")
    for struct, rows in mirrored.items():
        c_rows = compiled.get(struct)
        if c_rows is None:
            problems.append(f"struct {struct} is missing from abi_layout.c's table")
            continue
        for field, (offset, size) in rows.items():
            where = f"sizeof({struct})" if not field else f"{struct}.{field}"
            if field not in c_rows:
                row = f"FIELD({struct}, {field})" if field else f"STRUCT({struct})"
                problems.append(f"{where} is missing from abi_layout.c's table (add {row})")
            elif c_rows[field] != (offset, size):
                c_offset, c_size = c_rows[field]
                problems.append(
                    f"{struct} is {c_size} bytes in C but {size} in ctypes"
                    if not field
                    else f"{where} is at offset {c_offset}, {c_size} bytes in C but at offset "
                    f"{offset}, {size} bytes in ctypes"
                )
        for field in sorted(c_rows.keys() - rows.keys()):
            problems.append(
                f"{struct}.{field} is in abi_layout.c's table but not in the header's struct"
            )
    return sorted(problems)


def check_layout(lib: ctypes.CDLL, structs: Structures | None = None) -> None:
    """AbiError naming every struct and field whose compiled layout differs from its ctypes
    mirror's (`structs`: the headers' by default)."""
    problems = layout_mismatches(
        compiled_layout(lib), ctypes_layout(structures() if structs is None else structs)
    )
    if problems:
        raise AbiError(
            "the native CPU kernels' structs differ from their ctypes mirrors built from "
            f"wick_stack.h: {'; '.join(problems)}"
        )
