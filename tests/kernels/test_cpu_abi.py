"""The native CPU kernels' C interface, declared once in the headers (kernels/cpu/c_header.py
reads them, kernels/cpu/abi.py makes ctypes of them): the reader on sample declarations and on
what it refuses; every function of the headers bound with the declared types and every entry
point the Python side calls declared; the layout check passing on the real build and refusing,
by struct and field, a library or a mirror that differs (the loader then falls back)."""

from __future__ import annotations

import ctypes
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from model_server.kernels.cpu import abi, decoder_stack, native
from model_server.kernels.cpu.c_header import CType, HeaderError, parse_headers, parse_text

CPU_DIR = Path(native.__file__).parent


def _kernels() -> native.NativeKernels:
    kernels = native.load_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernels need a C compiler")
    return kernels


# ---- the reader --------------------------------------------------------------------------


def test_prototypes_with_pointers_const_and_arrays() -> None:
    decls = parse_text(
        """
        #include <stdint.h>
        typedef uint16_t half_t;
        /* a comment { with braces } and a prototype-like text: int not_this(void); */
        const char *name(void);
        int64_t scale(const int64_t *restrict p, unsigned long int n, void *out,
                      const float rows[4], half_t h, const half_t *const *hp, signed s);
        void nothing(int);  // unnamed parameter
        extern double twice(double x);
        """
    )
    fns = decls.functions
    assert list(fns) == ["name", "scale", "nothing", "twice"]
    assert fns["name"].restype == CType("char", 1) and fns["name"].params == ()
    params = [(p.name, p.type) for p in fns["scale"].params]
    assert params == [
        ("p", CType("int64_t", 1)),
        ("n", CType("unsigned long")),
        ("out", CType("void", 1)),
        ("rows", CType("float", 1)),  # an array parameter is a pointer
        ("h", CType("uint16_t")),  # through the typedef
        ("hp", CType("uint16_t", 2)),
        ("s", CType("int")),
    ]
    assert fns["nothing"].restype == CType("void")
    assert [(p.name, p.type) for p in fns["nothing"].params] == [("", CType("int"))]
    assert fns["twice"].params[0].type == CType("double")


def test_structs_with_arrays_constants_and_nested_structs() -> None:
    decls = parse_text(
        """
        #ifndef GUARD
        #define GUARD
        #define N 3
        #define NOT_A_NUMBER 1.5f
        #define SHIFTED (1 << 2)
        #define AB(x) 1
        #define TWICE(x) ((x) * 2)
        enum { A = 2, B, C = N * 2 };
        typedef uint16_t half_t;
        typedef struct {
          half_t h;
          int32_t a[N], *p;
          double m[B][SHIFTED];
        } Inner;
        typedef struct Outer {
          Inner in, pair[2];
          const void *const q;
          char name[C];
          unsigned char bytes[A + 1];
        } Outer;
        int use(const Outer *o, Inner i);
        #endif
        """
    )
    assert decls.constants == {"N": 3, "SHIFTED": 4, "A": 2, "B": 3, "C": 6}
    inner, outer = decls.structs["Inner"], decls.structs["Outer"]
    assert [(f.name, f.type) for f in inner.fields] == [
        ("h", CType("uint16_t")),
        ("a", CType("int32_t", 0, (3,))),
        ("p", CType("int32_t", 1)),
        ("m", CType("double", 0, (3, 4))),
    ]
    assert [(f.name, f.type) for f in outer.fields] == [
        ("in", CType("Inner", is_struct=True)),
        ("pair", CType("Inner", 0, (2,), is_struct=True)),
        ("q", CType("void", 1)),
        ("name", CType("char", 0, (6,))),
        ("bytes", CType("unsigned char", 0, (3,))),
    ]
    structs = abi.build_structures(decls)
    mirror = structs["Outer"]
    assert mirror.pair.size == 2 * ctypes.sizeof(structs["Inner"])  # type: ignore[attr-defined]
    # h at 0 (2 bytes, padded to a's 4), a at 4, p at 16, m at 24 (96 bytes).
    assert ctypes.sizeof(structs["Inner"]) == 120
    assert structs["Inner"].m.offset == 24  # type: ignore[attr-defined]
    argtypes, restype = abi.function_types(decls.functions["use"], structs)
    assert argtypes == [ctypes.c_void_p, structs["Inner"]] and restype is ctypes.c_int


def test_static_definitions_and_bodies_are_skipped() -> None:
    decls = parse_text(
        """
        static inline float f(float x) {
          union { float f; int32_t i; } u = {x};
          if (x < 0.5f) { return -x; }
          const char *s = "}{;";
          return u.f;
        }
        static const int table[] = {1, 2, 3};
        static int helper(int a);
        int exported(int a);
        """
    )
    assert list(decls.functions) == ["exported"]


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("typedef union { int a; float b; } U;", "union"),
        ("typedef struct { int a : 3; } S;", "expected"),
        ("int f(int (*callback)(int));", "function pointers"),
        ("int f(const char *format, ...);", r"\.\.\."),
        ("int f(mystery_t x);", "unknown type mystery_t"),
        ("typedef struct { int a[SIZE]; } S;", "unknown constant SIZE"),
        ("typedef struct Opaque Opaque;", "opaque"),
        ("int counter;", "global variables"),
        ("int f(int a); long f(int a);", "declared twice"),
        ("typedef struct { int a; int a; } S;", "field a is declared twice"),
        ("typedef struct { int a[0]; } S;", "array size 0"),
        ("typedef struct { int tail[]; } S;", "without a size"),
        ("int f(struct Tagged *t);", "struct"),
        ('#include "other.h"\nint f(void);', "include"),
        ("int f(int a)", "not closed"),
    ],
)
def test_unsupported_declarations_are_refused(code: str, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        parse_text(code, "sample.h")


def test_quoted_includes_are_followed_once(tmp_path: Path) -> None:
    (tmp_path / "base.h").write_text("#pragma once\ntypedef uint16_t bf16_t;\n#define K 2\n")
    (tmp_path / "a.h").write_text('#include "base.h"\nint a(bf16_t *x);\n')
    (tmp_path / "b.h").write_text(
        '#include "base.h"\n#include "a.h"\ntypedef struct { bf16_t v[K]; } B;\n'
    )
    decls = parse_headers(tmp_path / "a.h", tmp_path / "b.h")
    assert decls.functions["a"].params[0].type == CType("uint16_t", 1)
    assert decls.functions["a"].header == "a.h"
    assert decls.structs["B"].fields[0].type == CType("uint16_t", 0, (2,))


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        ("unsigned long long int", ctypes.c_ulonglong),
        ("long unsigned", ctypes.c_ulong),
        ("signed char", ctypes.c_byte),
        ("unsigned", ctypes.c_uint),
        ("short int", ctypes.c_short),
        ("signed int", ctypes.c_int),
        ("uint8_t", ctypes.c_uint8),
        ("size_t", ctypes.c_size_t),
        ("char *", ctypes.c_char_p),  # a C string
        ("const char **", ctypes.c_void_p),
        ("float *", ctypes.c_void_p),  # addresses pass as ints: see abi.py
        ("void", None),
    ],
)
def test_ctypes_of_each_spelling(spelling: str, expected: object) -> None:
    function = parse_text(f"{spelling} f(void);").functions["f"]
    assert abi.function_types(function, {})[1] is expected


# ---- the real headers and build ----------------------------------------------------------


def test_every_declared_function_is_bound_with_its_declared_types() -> None:
    lib = _kernels().lib
    functions = abi.declarations().functions
    assert len(functions) >= 30
    structs = abi.structures()
    for function in functions.values():
        entry = getattr(lib, function.name)
        argtypes, restype = abi.function_types(function, structs)
        assert list(entry.argtypes) == argtypes, function.name
        assert entry.restype is restype, function.name
    # A name the headers do not declare cannot be called with ctypes' default conversions.
    assert isinstance(lib, abi.BoundLibrary)
    with pytest.raises(AttributeError, match=r"wick_undeclared is not declared in wick_entry\.h"):
        lib.wick_undeclared  # noqa: B018
    # Spot checks against what the hand-written bindings said.
    assert lib.wick_isa.restype is ctypes.c_char_p
    assert lib.wick_panel_pack.restype is None
    assert list(lib.wick_gemm_packed.argtypes) == [ctypes.c_void_p]
    windowed = list(lib.wick_paged_attention_windowed.argtypes)
    extra = [ctypes.c_int, ctypes.c_float, ctypes.c_float]  # window, soft cap, static KV scale
    assert windowed == [*lib.wick_paged_attention.argtypes, *extra]


def _python_entry_points() -> set[str]:
    """The entry points the Python side names: `lib.wick_x` and "wick_x" strings."""
    names: set[str] = set()
    for path in CPU_DIR.glob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\blib\.(wick_\w+)", text))
        names |= {n for n in re.findall(r"[\"'](wick_\w+)[\"']", text) if "." not in n}
    return names


def _exported_definitions() -> set[str]:
    """Non-static `wick_*` functions defined in the C sources."""
    pattern = re.compile(r"^(?!static)[A-Za-z_][\w \*]*?\b(wick_\w+)\s*\(", re.MULTILINE)
    return {m for path in native.SOURCES for m in pattern.findall(path.read_text())}


def test_every_entry_point_is_declared_in_a_header() -> None:
    declared = set(abi.declarations().functions)
    called = _python_entry_points()
    assert {"wick_decoder_stack", "wick_gemm_packed", "wick_gguf_q8_gemm"} <= called
    assert called - declared == set()
    # Every function the library exports is declared too (and so bound and compiler-checked).
    assert _exported_definitions() - declared == set()


def test_every_source_defining_an_entry_point_includes_its_header() -> None:
    # The compiler checks a definition against its prototype only where the header is included.
    for path in native.SOURCES:
        text = path.read_text()
        defined = _exported_definitions() & set(re.findall(r"\b(wick_\w+)\s*\(", text))
        headers = {abi.declarations().functions[name].header for name in defined}
        for header in headers:
            assert f'#include "{header}"' in text, (path.name, header)
    assert set(abi.ABI_HEADERS) <= set(native.HEADERS)


def test_layout_check_passes_on_the_real_build() -> None:
    lib = _kernels().lib
    abi.check_layout(lib)
    compiled = abi.compiled_layout(lib)
    mirrored = abi.ctypes_layout(abi.structures())
    assert compiled == mirrored
    assert set(compiled) == {
        "WickLoRA",
        "WickLinear",
        "WickExpertsWNA16",
        "WickExpertsPanels",
        "WickGroupedTopk",
        "WickMoE",
        "WickMLA",
        "WickLayer",
        "WickStackStep",
    }


def test_decoder_stack_takes_its_structs_and_constants_from_the_header() -> None:
    assert decoder_stack.WickLayer is abi.structure("WickLayer")
    assert decoder_stack.WickLinear is abi.structure("WickLinear")
    assert decoder_stack.WickStackStep is abi.structure("WickStackStep")
    assert decoder_stack.LINEAR_PANELS_BF16 == 0 and decoder_stack.LINEAR_PANELS_F32 == 1
    assert decoder_stack.LINEAR_GGUF == 2
    assert decoder_stack.MAX_SEGMENTS == 4
    fields = dict(decoder_stack.WickStackStep._fields_)
    assert all(fields[name] is ctypes.c_void_p for name in decoder_stack._BUFFERS)
    linear = decoder_stack.WickLinear()
    assert len(linear.segment_blocks) == decoder_stack.MAX_SEGMENTS


# ---- mismatches are refused --------------------------------------------------------------


def _header_copy(tmp_path: Path, old: str, new: str) -> Path:
    """wick_stack.h (with what it includes and abi_layout.c) copied to tmp_path, `old`
    replaced by `new` in the copy."""
    for name in ("wick_cpu.h", "wick_lora.h", "wick_moe.h", "wick_moe_wna16.h",
                 "wick_moe_routing.h", "abi_layout.c"):  # fmt: skip
        shutil.copy(CPU_DIR / name, tmp_path / name)
    text = (CPU_DIR / "wick_stack.h").read_text()
    assert text.count(old) == 1
    (tmp_path / "wick_stack.h").write_text(text.replace(old, new))
    return tmp_path / "wick_stack.h"


def test_a_wrong_mirror_is_refused_naming_struct_and_field(tmp_path: Path) -> None:
    lib = _kernels().lib
    header = _header_copy(tmp_path, "int32_t fuse_silu;", "int64_t fuse_silu;")
    wrong = abi.build_structures(parse_headers(header))
    real, widened = _fuse_silu_offset(abi.structures()), _fuse_silu_offset(wrong)
    expected = f"WickLayer.fuse_silu is at offset {real}, 4 bytes in C but at offset {widened}, 8"
    with pytest.raises(abi.AbiError, match=re.escape(expected)):
        abi.check_layout(lib, wrong)


def _fuse_silu_offset(structs: abi.Structures) -> int:
    return structs["WickLayer"].fuse_silu.offset  # type: ignore[attr-defined]


def test_a_field_missing_from_the_layout_table_is_refused(tmp_path: Path) -> None:
    # A field added to the header but not to abi_layout.c's table: the mirror has it, C's
    # table does not (here the library's struct lacks it too: its size differs as well).
    lib = _kernels().lib
    header = _header_copy(tmp_path, "int32_t fuse_silu;", "int32_t fuse_silu, new_flag;")
    grown = abi.build_structures(parse_headers(header))
    with pytest.raises(abi.AbiError) as refused:
        abi.check_layout(lib, grown)
    message = str(refused.value)
    assert "WickLayer.new_flag is missing from abi_layout.c's table" in message
    assert "FIELD(WickLayer, new_flag)" in message
    # A table row the header lacks is named too.
    fewer = abi.build_structures(
        parse_headers(_header_copy(tmp_path, "  int32_t fuse_silu;", "  int32_t fuse_silu_x;"))
    )
    with pytest.raises(abi.AbiError, match=r"WickLayer\.fuse_silu is in abi_layout.c's table"):
        abi.check_layout(lib, fewer)


def _compile(tmp_path: Path, source: Path) -> ctypes.CDLL:
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    target = tmp_path / "libwick_abi_test.so"
    proc = subprocess.run(
        [cc, "-shared", "-fPIC", "-std=c11", "-O0", str(source), "-o", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(target))


def test_a_library_built_from_a_changed_header_is_refused(tmp_path: Path) -> None:
    # The C side compiled with a field's type changed (the Python side reads the real header).
    header = _header_copy(tmp_path, "int32_t fuse_silu;", "int64_t fuse_silu;")
    lib = _compile(tmp_path, tmp_path / "abi_layout.c")
    with pytest.raises(abi.AbiError) as refused:
        abi.check_layout(lib)
    widened = _fuse_silu_offset(abi.build_structures(parse_headers(header)))
    real = _fuse_silu_offset(abi.structures())
    expected = f"WickLayer.fuse_silu is at offset {widened}, 8 bytes in C but at offset {real}, 4"
    assert expected in str(refused.value)
    # And a library lacking declared functions is refused before anything is called.
    with pytest.raises(abi.AbiError, match="lacks functions its headers declare: wick_rms_norm"):
        abi.bind(lib)


def test_the_loader_refuses_a_mismatched_library_and_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _kernels()  # built (and cached on disk) with the real headers
    header = _header_copy(tmp_path, "int32_t fuse_silu;", "int64_t fuse_silu;")
    wrong = abi.build_structures(parse_headers(header))
    monkeypatch.setattr(abi, "structures", lambda: wrong)
    native.clear_cache()
    try:
        with caplog.at_level(logging.ERROR, logger=native.__name__):
            assert native.load_kernels() is None
    finally:
        monkeypatch.undo()
        native.clear_cache()
    assert "native CPU kernels refused" in caplog.text
    assert "WickLayer.fuse_silu" in caplog.text
    assert native.load_kernels() is not None
