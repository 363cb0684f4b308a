"""A reader of the C declarations in the native kernels' headers, for kernels/cpu/abi.py: integer
constants (`#define NAME <integer expression>`, enum constants), typedefs, typedef'd structs and
function prototypes, as plain data (no ctypes here).

It reads the subset of C those headers use and refuses anything else with a HeaderError that
names the header and the declaration, rather than guess at a layout: types are the C scalar
types (int, unsigned long, char, float, double, ...), the <stdint.h> ones, typedefs of them and
the header's own typedef'd structs by name, with `const`, pointers, and arrays whose sizes are
integer expressions of numbers and constants. Unions, bit-fields, function pointers, variadic
functions, opaque and tagged-only structs and global variables are refused. Skipped: `static`
declarations and definitions (not part of a library's interface), function bodies, and
preprocessor lines other than #include "..." (followed, once per header) and integer #defines;
#if is not evaluated, so declarations must not depend on it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Single-word spellings that name a type without a typedef of the header's.
STDINT_TYPES = frozenset(
    {
        *(f"{sign}int{bits}_t" for sign in ("", "u") for bits in (8, 16, 32, 64)),
        "size_t",
        "ssize_t",
        "ptrdiff_t",
        "intptr_t",
        "uintptr_t",
        "bool",
    }
)
# Words of the built-in types' spellings ("unsigned long long int").
_SCALAR_WORDS = frozenset(
    {"void", "char", "short", "int", "long", "signed", "unsigned", "float", "double", "_Bool"}
)
_QUALIFIERS = frozenset({"const", "volatile", "restrict", "__restrict", "__restrict__"})
_UNSUPPORTED = frozenset({"union", "struct", "enum", "__attribute__", "_Alignas", "...", ":"})

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
      | (?P<word>[A-Za-z_]\w*)
      | (?P<number>(?:0[xX][0-9a-fA-F]+|\d+)[uUlL]*(?![\w.]))
      | (?P<punct>\.\.\.|<<|>>|\S)
    )""",
    re.VERBOSE,
)
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DEFINE = re.compile(r"#\s*define\s+([A-Za-z_]\w*)(?![\w(])\s*(.*)")  # not NAME(args)
_INCLUDE = re.compile(r'#\s*include\s*"([^"]+)"')


class HeaderError(ValueError):
    """A declaration outside the subset this module reads, or an inconsistent one."""


@dataclass(frozen=True)
class CType:
    """A type: `name` is a built-in's canonical spelling ("int", "unsigned long", "int64_t",
    "void") or a struct's typedef name (`is_struct`), under `pointers` levels of indirection;
    `dims` are its array dimensions, outermost first."""

    name: str
    pointers: int = 0
    dims: tuple[int, ...] = ()
    is_struct: bool = False

    def __str__(self) -> str:
        stars = " " + "*" * self.pointers if self.pointers else ""
        return self.name + stars + "".join(f"[{d}]" for d in self.dims)


@dataclass(frozen=True)
class Field:
    """A struct member or a function parameter (`name` "" for an unnamed parameter)."""

    name: str
    type: CType


@dataclass(frozen=True)
class Struct:
    name: str
    fields: tuple[Field, ...]
    header: str  # the file name that declares it, for messages


@dataclass(frozen=True)
class Function:
    name: str
    restype: CType
    params: tuple[Field, ...]
    header: str


@dataclass
class Declarations:
    """Everything read, in declaration order."""

    constants: dict[str, int] = field(default_factory=dict)
    typedefs: dict[str, CType] = field(default_factory=dict)
    structs: dict[str, Struct] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)


def parse_headers(*paths: Path) -> Declarations:
    """The declarations of `paths` and of the headers they include by quotes (resolved next to
    the including header; each read once, as include guards would)."""
    reader = _Reader(lambda header, name: header.parent / name)
    for path in paths:
        reader.read(Path(path))
    return reader.decls


def parse_text(text: str, name: str = "<text>") -> Declarations:
    """The declarations of one header's text (#include "..." lines are refused: no files)."""

    def no_includes(header: Path, included: str) -> Path:
        raise HeaderError(f'{name}: #include "{included}" in a header read from text')

    reader = _Reader(no_includes)
    reader.read_text(text, name)
    return reader.decls


class _Reader:
    def __init__(self, resolve: Callable[[Path, str], Path]) -> None:
        self.decls = Declarations()
        self._resolve = resolve
        self._seen: set[Path] = set()
        self._header = ""

    def read(self, path: Path) -> None:
        path = path.resolve()
        if path in self._seen:
            return
        self._seen.add(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise HeaderError(f"cannot read {path}: {exc}") from exc
        self.read_text(text, path.name, path)

    def read_text(self, text: str, name: str, path: Path | None = None) -> None:
        text = _COMMENT.sub(" ", text).replace("\\\n", " ")
        code: list[str] = []
        # Directives first: included typedefs and #define constants are known before this
        # header's declarations are read (C needs them declared earlier anyway).
        for line in text.splitlines():
            stripped = line.strip()
            if not stripped.startswith("#"):
                code.append(line)
            elif (include := _INCLUDE.match(stripped)) is not None:
                self.read(self._resolve(path or Path(name), include.group(1)))
            elif (define := _DEFINE.match(stripped)) is not None and define.group(2).strip():
                self._header = name
                try:
                    value = self._eval(_tokens(define.group(2)), define.group(2))
                except HeaderError:
                    continue  # not an integer constant (a macro of code): no type uses it
                self.decls.constants[define.group(1)] = value
        self._header = name
        for statement in _statements(_tokens("\n".join(code)), name):
            self._statement(statement)

    # ---- statements ------------------------------------------------------------------------

    def _error(self, statement: list[str], why: str) -> HeaderError:
        text = " ".join(statement)
        return HeaderError(f"{self._header}: {why}: `{text[:160]}`")

    def _statement(self, s: list[str]) -> None:
        if s[0] == "static":
            return  # internal to its file: not part of the library's interface
        if s[0] == "extern":
            s = s[1:]
        if s[0] == "typedef" and len(s) > 1 and s[1] == "struct":
            self._struct(s)
        elif s[0] == "typedef" and len(s) > 1 and s[1] == "enum":
            end = self._enum(s, 1)
            if end != len(s) - 1 or not _is_word(s[end]):
                raise self._error(s, "expected `typedef enum {...} Name;`")
            self.decls.typedefs[s[end]] = CType("int")
        elif s[0] == "enum":
            if self._enum(s, 0) != len(s):
                raise self._error(s, "expected `enum {...};`")
        elif s[0] == "typedef":
            pos, base = self._specifiers(s, 1)
            pos, name, ctype = self._declarator(s, pos, base)
            if pos != len(s) or not name:
                raise self._error(s, "expected `typedef <type> <name>;`")
            if ctype.dims:
                raise self._error(s, "typedefs of arrays are not supported")
            self._define_type(s, name, ctype, self.decls.typedefs)
        elif "(" in s:
            self._function(s)
        else:
            raise self._error(s, "global variables and this kind of declaration are not supported")

    def _define_type(self, s: list[str], name: str, value: object, into: dict) -> None:
        known = name in self.decls.typedefs or name in self.decls.structs
        if known and into.get(name) != value:
            raise self._error(s, f"{name} is declared twice")
        into[name] = value

    def _struct(self, s: list[str]) -> None:
        # typedef struct [Tag] { fields } Name ;
        pos = 3 if len(s) > 2 and _is_word(s[2]) else 2
        if pos >= len(s) or s[pos] != "{":
            raise self._error(s, "opaque structs are not supported")
        close = _matching(s, pos)
        if close != len(s) - 2 or not _is_word(s[-1]):
            raise self._error(s, "expected `typedef struct {...} Name;`")
        fields: list[Field] = []
        for member in _split(s[pos + 1 : close], ";"):
            if not member:
                continue
            at, base = self._specifiers(member, 0)
            for declarator in _split(member[at:], ","):
                end, name, ctype = self._declarator(declarator, 0, base)
                if end != len(declarator) or not name:
                    raise self._error(member, "expected `<type> <name>[, <name>...];`")
                if ctype.name == "void" and not ctype.pointers:
                    raise self._error(member, f"field {name} is void")
                if any(f.name == name for f in fields):
                    raise self._error(member, f"field {name} is declared twice")
                fields.append(Field(name, ctype))
        if not fields:
            raise self._error(s, "empty structs are not supported")
        struct = Struct(s[-1], tuple(fields), self._header)
        self._define_type(s, struct.name, struct, self.decls.structs)

    def _enum(self, s: list[str], start: int) -> int:
        """Reads `enum [Tag] { A [= expr], ... }` from s[start]; the index after its `}`."""
        pos = start + 1
        if pos < len(s) and _is_word(s[pos]):
            pos += 1
        if pos >= len(s) or s[pos] != "{":
            raise self._error(s, "expected an enum body")
        close = _matching(s, pos)
        value = -1
        for item in _split(s[pos + 1 : close], ","):
            if not item:
                continue
            if not _is_word(item[0]) or (len(item) > 1 and item[1] != "="):
                raise self._error(s, "expected `NAME [= value]` in the enum")
            value = self._eval(item[2:], " ".join(item)) if len(item) > 1 else value + 1
            self.decls.constants[item[0]] = value
        return close + 1

    def _function(self, s: list[str]) -> None:
        pos, restype = self._specifiers(s, 0)
        pos, name, restype = self._declarator(s, pos, restype, allow_dims=False)
        if not name or pos >= len(s) or s[pos] != "(":
            raise self._error(s, "expected a function prototype")
        close = _matching(s, pos)
        if close != len(s) - 1:
            raise self._error(s, "only plain prototypes `<type> name(<params>);` are supported")
        inner = s[pos + 1 : close]
        params: list[Field] = []
        if inner != ["void"]:
            for param in _split(inner, ","):
                if not param:
                    raise self._error(s, "an empty parameter")
                at, base = self._specifiers(param, 0)
                end, pname, ctype = self._declarator(param, at, base)
                if end != len(param):
                    raise self._error(s, f"cannot read the parameter `{' '.join(param)}`")
                if ctype.dims:  # an array parameter is a pointer
                    ctype = CType(ctype.name, ctype.pointers + 1, (), ctype.is_struct)
                if ctype.name == "void" and not ctype.pointers:
                    raise self._error(s, "a void parameter next to others")
                params.append(Field(pname, ctype))
        function = Function(name, restype, tuple(params), self._header)
        known = self.decls.functions.get(name)
        if known is not None and (known.restype, _types(known)) != (restype, _types(function)):
            raise self._error(s, f"{name} is declared twice with different types")
        self.decls.functions.setdefault(name, function)

    # ---- types -----------------------------------------------------------------------------

    def _specifiers(self, s: list[str], pos: int) -> tuple[int, CType]:
        """The type named by the specifiers from s[pos] (qualifiers dropped): (the index
        after them, the type)."""
        words: list[str] = []
        named: str | None = None
        while pos < len(s):
            token = s[pos]
            if token in _UNSUPPORTED:
                raise self._error(s, f"`{token}` is not supported here")
            if token in _QUALIFIERS:
                pass
            elif token in _SCALAR_WORDS and named is None:
                words.append(token)
            elif _is_word(token) and not words and named is None:
                named = token
            else:
                break
            pos += 1
        if words:
            return pos, CType(_canonical(words, lambda why: self._error(s, why)))
        if named is None:
            raise self._error(s, "expected a type")
        if named in self.decls.typedefs:
            return pos, self.decls.typedefs[named]
        if named in self.decls.structs:
            return pos, CType(named, is_struct=True)
        if named in STDINT_TYPES:
            return pos, CType(named)
        raise self._error(s, f"unknown type {named}")

    def _declarator(
        self, s: list[str], pos: int, base: CType, allow_dims: bool = True
    ) -> tuple[int, str, CType]:
        """`* const * name [N][M]` from s[pos] over `base`: (the index after it, the name or ""
        when there is none, the type)."""
        pointers = 0
        while pos < len(s) and (s[pos] == "*" or s[pos] in _QUALIFIERS):
            pointers += s[pos] == "*"
            pos += 1
        name = ""
        if pos < len(s) and _is_word(s[pos]):
            name = s[pos]
            pos += 1
        if pos < len(s) and s[pos] == "(" and not name:
            raise self._error(s, "function pointers are not supported")
        dims: list[int] = []
        while allow_dims and pos < len(s) and s[pos] == "[":
            close = _matching(s, pos)
            if close == pos + 1:
                raise self._error(s, "arrays without a size are not supported")
            dims.append(self._eval(s[pos + 1 : close], " ".join(s)))
            if dims[-1] <= 0:
                raise self._error(s, f"array size {dims[-1]}")
            pos = close + 1
        ctype = CType(base.name, base.pointers + pointers, tuple(dims), base.is_struct)
        return pos, name, ctype

    def _eval(self, tokens: list[str], text: str) -> int:
        """An integer constant expression of numbers and known constants."""
        parts: list[str] = []
        for token in tokens:
            if _is_word(token):
                if token not in self.decls.constants:
                    raise HeaderError(f"{self._header}: unknown constant {token} in `{text}`")
                parts.append(str(self.decls.constants[token]))
            elif token[0].isdigit():
                parts.append(str(int(token.rstrip("uUlL"), 0)))
            elif token in ("+", "-", "*", "/", "%", "<<", ">>", "|", "&", "^", "~", "(", ")"):
                parts.append(token)
            else:
                raise HeaderError(f"{self._header}: not an integer expression: `{text}`")
        try:
            return _eval_int(ast.parse(" ".join(parts), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError) as exc:
            raise HeaderError(f"{self._header}: not an integer expression: `{text}`") from exc


_CANONICAL = {
    ("char",): "char",
    ("char", "signed"): "signed char",
    ("char", "unsigned"): "unsigned char",
    ("short",): "short",
    ("short", "unsigned"): "unsigned short",
    ("int",): "int",
    ("unsigned",): "unsigned int",
    ("long",): "long",
    ("long", "unsigned"): "unsigned long",
    ("long", "long"): "long long",
    ("long", "long", "unsigned"): "unsigned long long",
    ("float",): "float",
    ("double",): "double",
    ("double", "long"): "long double",
    ("void",): "void",
    ("_Bool",): "_Bool",
}


def _canonical(words: list[str], error: Callable[[str], HeaderError]) -> str:
    """`unsigned long int` -> "unsigned long": "int" is implied next to short, long, signed and
    unsigned, and "signed" everywhere but before char."""
    key = sorted(words)
    if "int" in key and len(key) > 1:
        key.remove("int")
    if "signed" in key and key != ["char", "signed"]:
        key.remove("signed")
    spelled = _CANONICAL.get(tuple(key or ["int"]))
    if spelled is None:
        raise error(f"`{' '.join(words)}` is not a type")
    return spelled


def _eval_int(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp):
        value = _eval_int(node.operand)
        unary: dict[type, Callable[[int], int]] = {
            ast.USub: lambda x: -x,
            ast.UAdd: lambda x: x,
            ast.Invert: lambda x: ~x,
        }
        if type(node.op) in unary:
            return unary[type(node.op)](value)
    if isinstance(node, ast.BinOp):
        a, b = _eval_int(node.left), _eval_int(node.right)
        ops: dict[type, Callable[[int, int], int]] = {
            ast.Add: lambda x, y: x + y,
            ast.Sub: lambda x, y: x - y,
            ast.Mult: lambda x, y: x * y,
            ast.Div: lambda x, y: int(x / y) if y else x // y,  # C truncates toward zero
            ast.Mod: lambda x, y: x - y * int(x / y) if y else x % y,
            ast.LShift: lambda x, y: x << y,
            ast.RShift: lambda x, y: x >> y,
            ast.BitOr: lambda x, y: x | y,
            ast.BitAnd: lambda x, y: x & y,
            ast.BitXor: lambda x, y: x ^ y,
        }
        if type(node.op) in ops:
            return ops[type(node.op)](a, b)
    raise ValueError("not an integer expression")


def _tokens(code: str) -> list[str]:
    out: list[str] = []
    for match in _TOKEN.finditer(code):
        token = match.group(match.lastgroup or "punct")
        out.append(token)
    return out


def _statements(tokens: list[str], header: str) -> Iterator[list[str]]:
    """Top-level declarations, without their `;`. A function definition ends at its body's
    closing brace and is dropped with the body."""
    statement: list[str] = []
    depth = 0
    body_start = -1
    for token in tokens:
        if token == "{":
            if depth == 0:
                body_start = len(statement)
            depth += 1
        elif token == "}":
            depth -= 1
            if depth < 0:
                raise HeaderError(f"{header}: unbalanced braces")
        if depth == 0 and token == ";":
            if statement:
                yield statement
            statement = []
            continue
        statement.append(token)
        if depth == 0 and token == "}" and _is_definition(statement, body_start):
            statement = []
    if statement or depth:
        raise HeaderError(f"{header}: a declaration is not closed: `{' '.join(statement)[:160]}`")


def _is_definition(statement: list[str], body_start: int) -> bool:
    """Whether the braces that just closed are a function's body: `... ) {`, outside a
    typedef, enum or struct."""
    return (
        statement[0] not in ("typedef", "enum", "struct", "union")
        and body_start > 0
        and statement[body_start - 1] == ")"
    )


def _matching(s: list[str], pos: int) -> int:
    """The index of the bracket closing s[pos]."""
    opening = s[pos]
    closing = {"(": ")", "[": "]", "{": "}"}[opening]
    depth = 0
    for i in range(pos, len(s)):
        depth += (s[i] == opening) - (s[i] == closing)
        if depth == 0:
            return i
    raise HeaderError(f"unclosed {opening} in `{' '.join(s)[:160]}`")


def _split(tokens: list[str], separator: str) -> list[list[str]]:
    """`tokens` split at `separator`s outside brackets."""
    parts: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        depth += (token in "([{") - (token in ")]}") if len(token) == 1 else 0
        if token == separator and depth == 0:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


def _is_word(token: str) -> bool:
    return token[0].isalpha() or token[0] == "_"


def _types(function: Function) -> tuple[CType, ...]:
    return tuple(p.type for p in function.params)
