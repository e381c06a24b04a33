"""Compile an mx.fast.metal_kernel body as C++ behind the MSL shim and run it.

The kernel source is assembled exactly as MLX's `write_signature` does
(mlx/backend/metal/custom_kernel.cpp), so the body under test is the body MLX
would hand to the Metal compiler. Only two things differ: MLX's own utils
header is replaced by `#include <metal_stdlib>` (the shim), and the explicit
instantiation omits the `[[host_name]] [[kernel]]` attributes, which C++ does
not allow there.
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM_DIR = Path(__file__).parent
COMPILERS = ("clang++-19", "clang++-20", "clang++-18", "clang++")
# MSL rounds every half and bfloat operation to its type; clang on x86 would by default
# keep _Float16/__bf16 intermediates in float ("excess precision"), so that is turned off.
FLAGS = (
    "-std=c++20",
    "-O2",
    "-pthread",
    "-rtlib=compiler-rt",
    "-Wno-unknown-attributes",
    *("-Xclang", "-ffloat16-excess-precision=none"),
    *("-Xclang", "-fbfloat16-excess-precision=none"),
)
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX binds smaller inputs in the constant address space
METAL_ATTRIBUTES = (  # (name, type) in the order MLX appends them
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# MLX dtype -> (Metal type string, numpy storage dtype)
TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint32: ("uint32_t", np.uint32),
    mx.bool_: ("bool", np.bool_),
}
PROBE = """
typedef float float4 __attribute__((ext_vector_type(4)));
int main() { _Float16 h = 1; __bf16 b = (__bf16)(float)h; float4 v = {1, 2, 3, 4};
  return int(float(b) + v.w) == 5 ? 0 : 1; }
"""


class EmulatorError(RuntimeError):
    """The emulated kernel failed at run time (divergence, stray write, crash)."""


class CompileError(RuntimeError):
    """The kernel source did not compile as C++ behind the shim."""


@dataclass
class Tensor:
    """A kernel input or output: numpy storage (uint16 for bfloat16) and its MLX dtype."""

    data: np.ndarray
    dtype: mx.Dtype

    @classmethod
    def from_mx(cls, a: mx.array) -> "Tensor":
        storage = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        return cls(np.array(storage), a.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def to_mx(self) -> mx.array:
        a = mx.array(self.data)
        return a.view(mx.bfloat16) if self.dtype == mx.bfloat16 else a


def _build(
    compiler: str, source: str, out: Path, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    src = out.with_suffix(".cpp")
    src.write_text(source)
    cmd = [compiler, *FLAGS, *flags, f"-I{SHIM_DIR}", str(src), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.cache
def find_compiler() -> str | None:
    """The first clang that builds the probe (_Float16, __bf16, vector types), or None."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in COMPILERS:
            path = shutil.which(name)
            if path and _build(path, PROBE, Path(tmp) / "probe").returncode == 0:
                return path
    return None


def _template_string(template) -> str:
    def value(v):
        if isinstance(v, mx.Dtype):
            return TYPES[v][0]
        return str(int(v))  # MLX streams bools as 0/1

    return "<" + ", ".join(value(v) for _, v in template) + ">"


def kernel_source(
    name, input_names, output_names, source, header, inputs, output_dtypes, template
) -> tuple[str, str, list, list[str]]:
    """MLX's generated source for these inputs: (source, kernel name, shape infos, attributes).

    `inputs` are (shape, dtype) pairs.
    """
    shape_infos = [
        tuple(f"{n}{s}" in source for s in ("_shape", "_strides", "_ndim")) for n in input_names
    ]
    attributes = [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]
    kname = f"custom_kernel_{name}"
    tdef = ""
    if template:
        tdef = _template_string(template)
        kname += "_" + re.sub(r"<|>|(, )", "_", tdef)[:-1]
    for shape, dtype in inputs:
        size = int(np.prod(shape))
        kname += "_" + TYPES[dtype][0]
        kname += "s" if len(shape) == 0 else ("c" if size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dtype in output_dtypes:
        kname += "_" + TYPES[dtype][0]

    # MLX's utils header brings in namespace metal; a `threadgroup` pointer parameter is
    # ordinary memory here (the shim's `threadgroup` declares per-threadgroup arrays)
    header, source = (re.sub(r"\bthreadgroup\s+(\w+\s*\*)", r"\1", s) for s in (header, source))
    src = "#include <metal_stdlib>\nusing namespace metal;\n" + header
    if template:
        kinds = [
            "typename" if isinstance(v, mx.Dtype) else "bool" if isinstance(v, bool) else "int"
            for _, v in template
        ]
        src += (
            "template <"
            + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template, strict=True))
            + ">\n"
        )
    src += f"[[kernel]] void {kname}(\n"
    index = 0
    for n, (shape, dtype), info in zip(input_names, inputs, shape_infos, strict=True):
        size = int(np.prod(shape))
        location = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(shape) == 0 else "*"
        src += f"  const {location} {TYPES[dtype][0]}{ref} {n} [[buffer({index})]],\n"
        index += 1
        if len(shape) > 0:
            for present, decl in zip(
                info,
                (
                    "const constant int* {}_shape",
                    "const constant int64_t* {}_strides",
                    "const constant int& {}_ndim",
                ),
                strict=True,
            ):
                if present:
                    src += f"  {decl.format(n)} [[buffer({index})]],\n"
                    index += 1
    for n, dtype in zip(output_names, output_dtypes, strict=True):
        src += f"  device {TYPES[dtype][0]}* {n} [[buffer({index})]]"
        last = index >= len(inputs) + len(output_names) - 1 and not attributes
        src += ") {\n" if last else ",\n"
        index += 1
    src += ",\n".join(attributes) + (") {\n" if attributes else "")
    src += source + "\n}\n"
    if template:
        src += f"\ntemplate decltype({kname}{tdef}) {kname}{tdef};\n"
    return src, kname + tdef, shape_infos, [a.split()[1] for a in attributes]


def _entry(kname, inputs, output_dtypes, shape_infos, attributes) -> str:
    """C++ glue: call the kernel with the buffers and attributes MLX would bind."""
    args, index = [], 0
    for (shape, dtype), info in zip(inputs, shape_infos, strict=True):
        ctype = TYPES[dtype][0]
        args.append(
            f"*(const {ctype}*)b[{index}]" if len(shape) == 0 else f"(const {ctype}*)b[{index}]"
        )
        index += 1
        if len(shape) > 0:
            for present, ctype in zip(
                info, ("const int*", "const int64_t*", "const int&"), strict=True
            ):
                if present:
                    cast = (
                        f"*(const int*)b[{index}]"
                        if ctype == "const int&"
                        else f"({ctype})b[{index}]"
                    )
                    args.append(cast)
                    index += 1
    for dtype in output_dtypes:
        args.append(f"({TYPES[dtype][0]}*)b[{index}]")
        index += 1
    args += [f"a.{name}" for name in attributes]
    return (
        "\nstatic void dflash_emu_entry(void** b, const emu::Attrs& a) {\n"
        f"  {kname}(\n    " + ",\n    ".join(args) + ");\n}\n"
        "int main(int argc, char** argv) { return emu::main(argc, argv, dflash_emu_entry); }\n"
    )


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "dflash_msl_emu"
    path.mkdir(exist_ok=True)
    return path


def _compiler() -> str:
    compiler = find_compiler()
    if compiler is None:
        raise CompileError(
            "no C++ compiler with _Float16/__bf16 support (apt-get install clang-19)"
        )
    return compiler


def _shim_key() -> str:
    shim = "".join((SHIM_DIR / f).read_text() for f in ("msl_shim.h", "emu_runtime.h"))
    return hashlib.sha256("\0".join([_compiler(), *FLAGS, shim]).encode()).hexdigest()[:24]


@functools.cache
def _precompiled_shim() -> Path:
    """The shim and runtime parsed once (a clang precompiled header): parsing them is most of
    a kernel's compile time, and a run compiles every kernel variant it meets."""
    # clang refuses a header that moved or changed since: its path and times are in the key
    headers = [SHIM_DIR / f for f in ("metal_stdlib", "msl_shim.h", "emu_runtime.h")]
    stamp = "\0".join(f"{h}:{h.stat().st_mtime_ns}" for h in headers)
    key = hashlib.sha256(f"{_shim_key()}\0{stamp}".encode()).hexdigest()[:24]
    out = _cache_dir() / f"shim_{key}.pch"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}")
        cmd = [_compiler(), *FLAGS, "-x", "c++-header", str(SHIM_DIR / "metal_stdlib")]
        result = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
        if result.returncode != 0:
            raise CompileError(result.stderr[-4000:])
        tmp.replace(out)
    return out


@functools.cache
def _binary(source: str) -> Path:
    key = hashlib.sha256(f"{_shim_key()}\0{source}".encode()).hexdigest()[:24]
    out = _cache_dir() / f"kernel_{key}"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}")
        result = _build(_compiler(), source, tmp, ("-include-pch", str(_precompiled_shim())))
        if result.returncode != 0:
            raise CompileError(result.stderr[-4000:])
        tmp.replace(out)
    return out


def _record(data: np.ndarray, is_output: bool) -> bytes:
    """One buffer of the input file: the memory spanned by a (possibly strided) view."""
    if data.size == 0:
        return struct.pack("<3Q", 0, 0, int(is_output))
    first = data.__array_interface__["data"][0]
    low, high = np.lib.array_utils.byte_bounds(data)
    raw = ctypes.string_at(low, high - low)
    return struct.pack("<3Q", len(raw), first - low, int(is_output)) + raw


def run(
    name,
    input_names,
    output_names,
    source,
    header,
    inputs,
    template,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    ensure_row_contiguous=True,
    workers=None,
) -> list[Tensor]:
    """Emulate one mx.fast.metal_kernel call.

    `inputs` are Tensors (strided numpy views are bound in place, like MLX does
    with ensure_row_contiguous=False) or mx.arrays (bound contiguous).
    """
    inputs = [t if isinstance(t, Tensor) else Tensor.from_mx(mx.array(t)) for t in inputs]
    if ensure_row_contiguous:
        inputs = [Tensor(np.require(t.data, requirements="C"), t.dtype) for t in inputs]
    tg = tuple(min(t, g) for t, g in zip(threadgroup, grid, strict=True))
    shapes = [(t.data.shape, t.dtype) for t in inputs]
    src, kname, shape_infos, attributes = kernel_source(
        name, input_names, output_names, source, header, shapes, output_dtypes, template
    )
    binary = _binary(src + _entry(kname, shapes, output_dtypes, shape_infos, attributes))

    blob = []
    for t, info in zip(inputs, shape_infos, strict=True):
        blob.append(_record(t.data, False))
        if t.data.ndim > 0:
            itemsize = t.data.itemsize
            extras = (
                np.array(t.data.shape, np.int32),
                np.array([s // itemsize for s in t.data.strides], np.int64),
                np.array([t.data.ndim], np.int32),
            )
            blob += [_record(e, False) for e, present in zip(extras, info, strict=True) if present]
    outputs = [np.empty(s, TYPES[d][1]) for s, d in zip(output_shapes, output_dtypes, strict=True)]
    blob += [_record(o, True) for o in outputs]
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        inp.write_bytes(b"".join(blob))
        n_workers = workers or min(2, os.cpu_count() or 1)
        cmd = [str(binary), str(inp), str(outp), *map(str, grid), *map(str, tg), str(n_workers)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulatorError(result.stderr.strip() or f"exit status {result.returncode}")
        raw = outp.read_bytes()
    results, pos = [], 0
    for o, d in zip(outputs, output_dtypes, strict=True):
        results.append(
            Tensor(np.frombuffer(raw[pos : pos + o.nbytes], o.dtype).reshape(o.shape), d)
        )
        pos += o.nbytes
    return results


def metal_kernel(
    name,
    input_names,
    output_names,
    source,
    header="",
    ensure_row_contiguous=True,
    atomic_outputs=False,
):
    """Drop-in for mx.fast.metal_kernel that runs the kernel in the emulator."""
    if atomic_outputs:
        raise NotImplementedError("atomic outputs are not emulated")

    def call(
        *,
        inputs,
        template=(),
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        if init_value is not None:
            raise NotImplementedError("init_value is not emulated")
        outs = run(
            name,
            input_names,
            output_names,
            source,
            header,
            inputs,
            list(template),
            grid,
            threadgroup,
            output_shapes,
            output_dtypes,
            ensure_row_contiguous,
        )
        return [o.to_mx() for o in outs]

    return call
