"""The fused CPU kernels of quantization="q4": `csrc/gguf_gemv.c`, compiled once with the system C
compiler. `q4_1_matmul` multiplies by Q4_1 blocks (SmolLM2's linears), `q8_0_matmul` by Q8_0 blocks
(its token_embd, the tied lm_head); `q4_1_dequantize` and `q8_0_dequantize` write the float32
weights for the products of many rows, which a float GEMM does faster. `q4_1_swiglu` is a whole MLP,
`q4_1_attention_inputs` and `q4_1_attention_output_and_mlp` the two halves of a decoder layer around
its attention (`q4_layer.Q4DecoderLayer`). The same library holds `csrc/paged_decode.c`, the engine's
paged decode attention (`decodelab.engine.paged_decode_kernel`).

The C source is shipped with the package and compiled on first use into the user cache
(`decodelab.paths.cache_dir() / "kernels"`), under a name keyed by the source's hash and the
compiler command, then loaded with ctypes. It needs an x86-64 CPU with AVX2, FMA and F16C, a C
compiler (`$CC`, else `cc`) and OpenMP. Where any of these is missing, or
``DECODELAB_Q4_KERNEL=0`` is set, `kernel()` returns None after one line on stderr (once per
process) saying why, and `Q4Linear` takes its pure-torch path instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from decodelab.model import thread_team
from decodelab.paths import cache_dir

# The GGUF block products, and the paged decode attention the engine uses (`engine.paged_decode_kernel`):
# one library.
SOURCES = (Path(__file__).parent / "csrc" / "gguf_gemv.c", Path(__file__).parent / "csrc" / "paged_decode.c")
KERNEL_ENV = "DECODELAB_Q4_KERNEL"  # "0": always the pure-torch path
# Multiply-adds below which one thread beats two whose OpenMP team sleeps between products
# (OMP_WAIT_POLICY=PASSIVE, which `import decodelab` sets): waking it costs more than it saves.
# Measured by bench/q4_products.py (a SmolLM2 layer's products at 1 and 4 rows run faster alone).
ONE_THREAD_BELOW = 1 << 22
# The fused SwiGLU MLP (`q4_1_swiglu`): up to 16 rows of x (measured there; it dequantizes a
# weight row again for every 4 rows, which the layer-by-layer products' row buffer avoids), and the
# multiply-adds below which it runs on one thread while the team sleeps (one wake for the whole MLP
# pays already at one row of SmolLM2's: bench/q4_products.py).
SWIGLU_MAX_ROWS = 16
SWIGLU_ONE_THREAD_BELOW = 1 << 20
# More rows: dequantize + F.linear (one GEMM) is faster. bench/q4_products.py times the 211 products of a
# SmolLM2 pass: the kernel's time grows ~3 ms a row and the GEMM's ~1.5, so they cross at 32-40 rows on
# an AVX-512 Xeon with a 480 MiB L3 (two runs) and at ~52 on a 2-core EPYC (interpolated; the GEMM was
# 8% faster there at 64 rows). 48 sits between the two.
KERNEL_MAX_ROWS = 48
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
LIBRARIES = ["-lm"]  # after the source: expf


class KernelUnavailable(RuntimeError):
    """Why the fused kernels cannot run here (one line)."""


def _check_cpu() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"the CPU is {platform.machine()}, not x86-64")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = set()
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
        if missing:
            raise KernelUnavailable(f"the CPU lacks {', '.join(missing)}")


def _build() -> Path:
    """The compiled library's path, compiling it if the cache lacks it."""
    if os.environ.get(KERNEL_ENV, "1").strip() == "0":
        raise KernelUnavailable(f"{KERNEL_ENV}=0 is set")
    _check_cpu()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler found (set $CC, or install cc)")
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, *LIBRARIES]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"gguf_gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        try:
            result = subprocess.run(
                [compiler, *FLAGS, *map(str, SOURCES), "-o", str(partial), *LIBRARIES],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelUnavailable(f"compiling the kernels failed: {exc}") from None
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no message"])[0]
            raise KernelUnavailable(f"compiling the kernels with {compiler} failed: {first}")
        os.replace(partial, target)  # atomic: another process never loads a half-written file
    return target


@functools.cache
def _loaded_or_why() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded C library, "") or (None, why it cannot load), built and loaded once."""
    try:
        library = ctypes.CDLL(str(_build()))
    except (KernelUnavailable, OSError) as exc:
        return None, str(exc)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.q4_1_matmul.argtypes = [pointer] * 7 + [size, size, size, ctypes.c_int]
    library.q8_0_matmul.argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
    library.q4_1_dequantize.argtypes = [pointer, pointer, pointer, pointer, size, size, ctypes.c_int]
    library.q8_0_dequantize.argtypes = [pointer, pointer, pointer, size, size, ctypes.c_int]
    library.q4_1_swiglu.argtypes = [pointer] * 14 + [size, size, size, ctypes.c_int]
    library.paged_decode_attention.argtypes = [pointer] * 6 + [size] * 7 + [ctypes.c_float, pointer, ctypes.c_int]
    real, integer = ctypes.c_float, ctypes.c_int
    library.q4_1_attention_inputs.argtypes = [pointer, pointer, real] + [pointer] * 17 + [size] * 6 + [integer]
    library.q4_1_attention_output_and_mlp.argtypes = (
        [pointer] * 6 + [real] + [pointer] * 16 + [size] * 4 + [integer, integer]
    )
    step_front, step_back = [pointer, pointer, size, real, pointer, pointer, size], [real] + [pointer] * 14 + [size] * 6
    contiguous_cache, paged_cache = [pointer] * 3 + [size] * 2, [pointer, pointer, size] + [pointer] * 3 + [size] * 3
    library.q4_1_decode_layers.argtypes = step_front + contiguous_cache + step_back + [integer]
    library.q4_1_decode_layers_paged.argtypes = step_front + paged_cache + step_back + [integer]
    functions = (
        "q4_1_matmul",
        "q8_0_matmul",
        "q4_1_dequantize",
        "q8_0_dequantize",
        "q4_1_swiglu",
        "q4_1_attention_inputs",
        "q4_1_attention_output_and_mlp",
        "q4_1_decode_layers",
        "q4_1_decode_layers_paged",
        "paged_decode_attention",
    )
    for function in functions:
        getattr(library, function).restype = None
    return library, ""


@functools.cache
def kernel():
    """The loaded C library (`q4_1_matmul`, `q8_0_matmul`), or None (after one line on stderr saying why)."""
    library, why = _loaded_or_why()
    if library is None:
        print(f"decodelab: Q4_1 weights use the pure-torch path (slower): {why}", file=sys.stderr)
    return library


def prepared() -> str:
    """One line for `python -m decodelab prepare`, which builds the library ahead of time: where it
    lies, or why the kernels cannot load here (then the pure-torch paths run)."""
    library, why = _loaded_or_why()
    if library is None:
        return f"the C kernels cannot load here ({why}): q4 and the engine's decode attention run in torch"
    return f"{_build()} (the C kernels: q4 products, fused layers, the engine's decode attention)"


def kernel_loads() -> bool:
    """Do the C kernels load here? Asked before choosing Q4 weights, so it says nothing on stderr."""
    return _loaded_or_why()[0] is not None


def runs_on_kernel(x: torch.Tensor, weight_part: torch.Tensor, in_features: int) -> bool:
    """Will a block layer (`weight_part`: one of its block tensors) multiply `x` [..., in_features]
    with the C kernel? Float32 CPU input of 1..KERNEL_MAX_ROWS rows, no autograd, kernel loaded."""
    if x.dtype != torch.float32 or not x.is_cpu or not weight_part.is_cpu or in_features <= 0:
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return 0 < x.numel() // in_features <= KERNEL_MAX_ROWS and kernel() is not None


def threads_for(multiply_adds: int) -> int:
    """The threads a product of `multiply_adds` (M * N * K) gets: one for a small product while
    the OpenMP team sleeps between calls (`thread_team`), else torch's intra-op thread count."""
    return thread_team.threads_for(multiply_adds, ONE_THREAD_BELOW)


def swiglu_threads(rows: int, hidden: int, intermediate: int) -> int:
    """The threads the fused SwiGLU gets for `rows` rows ([rows, hidden] through [hidden, intermediate]
    products): one while the team sleeps and the MLP is small (SWIGLU_ONE_THREAD_BELOW), else all."""
    return thread_team.threads_for(3 * rows * hidden * intermediate, SWIGLU_ONE_THREAD_BELOW)


def _loaded():
    library = kernel()
    if library is None:
        raise KernelUnavailable("the GGUF block kernels are not loaded here")
    return library


def _product(function: str, x: torch.Tensor, blocks: tuple[torch.Tensor, ...], *scratch: torch.Tensor):
    """y [M, N] from the C product `function`(x, *blocks, y, *scratch, M, N, K, threads); N is
    blocks[0]'s rows."""
    rows, k = x.shape
    n = blocks[0].shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    pointers = [tensor.data_ptr() for tensor in (x, *blocks, y, *scratch)]
    getattr(_loaded(), function)(*pointers, rows, n, k, threads_for(rows * n * k))
    return y


Q4_1_DTYPES = (torch.uint8, torch.float16, torch.float16)  # nibbles, d, m: what the C reads them as


def q4_1_checked(blocks: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Q4_1 blocks (nibbles, d, m) as they are, once their dtypes are the C kernels' (`Q4_1_DTYPES`);
    else a TypeError, since the kernels would read another dtype's bytes as these."""
    if tuple(block.dtype for block in blocks) != Q4_1_DTYPES:
        got = ", ".join(str(block.dtype) for block in blocks)
        raise TypeError(f"Q4_1 blocks must be (nibbles uint8, d float16, m float16), got ({got})")
    return blocks


def _floats(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def int16_scratch(rows: int, *lengths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch in which the C kernels hold `rows` rows of each of `lengths` as 16-bit integers
    (the Q4_1 products' activations, `csrc/gguf_gemv.c`): int16 [rows * sum] values and float32
    [2 * rows * sum / 32] block scales and sums."""
    total = rows * sum(lengths)
    return torch.empty(total, dtype=torch.int16), torch.empty(2 * total // 32, dtype=torch.float32)


def q4_1_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """y [M, N] ~ x [M, K] @ W.T, W the Q4_1 weight of nibbles `qs` uint8 [N, K/2] and per-block
    scales `d`, offsets `m` float16 [N, K/32], through the C kernel (which must be loaded: `kernel()`).
    The kernel reads each block of 32 of x's values as 16-bit integers times a scale (`csrc/gguf_gemv.c`):
    within sum |W| * max|x_block| / 65534 of the float product. x float32 on the CPU, made contiguous
    here; qs, d, m contiguous. TypeError for blocks of other dtypes (the C reads raw memory)."""
    x = x.contiguous()
    return _product("q4_1_matmul", x, q4_1_checked((qs, d, m)), *int16_scratch(*x.shape))


def q8_0_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T, W the Q8_0 weight of `qs` int8 [N, K] and per-block scales `d`
    float32 [N, K/32], through the C kernel (which must be loaded: `kernel()`). x float32 on the
    CPU, made contiguous here; qs, d contiguous."""
    return _product("q8_0_matmul", x.contiguous(), (qs, d))


def q4_1_swiglu(
    x: torch.Tensor, gate: tuple[torch.Tensor, ...], up: tuple[torch.Tensor, ...], down: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """y [M, E] = (silu(x @ G.T) * (x @ U.T)) @ D.T for x float32 [M, E] (M <= SWIGLU_MAX_ROWS, CPU),
    G, U [F, E] and D [E, F] each Q4_1 blocks (nibbles, d, m), in one C call: one parallel region,
    each thread first a range of the F hidden units, then (past a spin barrier) a range of the E
    outputs (`csrc/gguf_gemv.c`; x and the hidden activations read as 16-bit integers, as
    `q4_1_matmul` reads x). The kernel must be loaded."""
    x = x.contiguous()
    rows, e = x.shape
    f = gate[0].shape[0]
    threads = swiglu_threads(rows, e, f)
    h = torch.empty(rows, f, dtype=torch.float32)
    y = torch.empty(rows, e, dtype=torch.float32)
    scratch = int16_scratch(rows, e, f)  # held here until the call returns
    pointers = [tensor.data_ptr() for tensor in (x, *gate, *up, *down, h, *scratch, y)]
    _loaded().q4_1_swiglu(*pointers, rows, e, f, threads)
    return y


def q4_1_attention_inputs(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    projections: tuple[tuple[torch.Tensor, ...], ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's half before its attention, in one C call: h = RMSNorm(x) (weight
    `norm_weight` [E], `eps`), q, k, v = h @ W.T for the Q4_1 blocks of q_proj, k_proj and v_proj
    (`projections`, each (nibbles, d, m) as `q4_1_matmul` takes them), and RoPE on q and k.
    x float32 [M, E] (rows [B, T] flattened); cos, sin float32 [T, D], contiguous. Returns q [M, H*D],
    k and v [M, H_kv*D]. The kernel must be loaded."""
    x = x.contiguous()
    rows, e = x.shape
    t = cos.shape[0]
    sizes = [blocks[0].shape[0] for blocks in projections]  # H*D, H_kv*D, H_kv*D
    h = torch.empty(rows, e, dtype=torch.float32)
    q, k, v = (torch.empty(rows, n, dtype=torch.float32) for n in sizes)
    threads = threads_for(rows * sum(sizes) * e)
    tensors = (*projections[0], *projections[1], *projections[2], cos, sin, h, *int16_scratch(rows, e), q, k, v)
    _loaded().q4_1_attention_inputs(
        x.data_ptr(),
        norm_weight.data_ptr(),
        eps,
        *[tensor.data_ptr() for tensor in tensors],
        rows,
        t,
        e,
        sizes[0] // head_dim,
        sizes[1] // head_dim,
        head_dim,
        threads,
    )
    return q, k, v


def q4_1_attention_output_and_mlp(
    x: torch.Tensor,
    attention: torch.Tensor,
    o_proj: tuple[torch.Tensor, ...],
    norm_weight: torch.Tensor,
    eps: float,
    mlp: tuple[tuple[torch.Tensor, ...], ...],
) -> torch.Tensor:
    """A decoder layer's half after its attention, in one C call: mid = x + attention @ O.T (o_proj's
    Q4_1 blocks), then mid + MLP(RMSNorm(mid)), the MLP as `q4_1_swiglu` (gate, up, down blocks in
    `mlp`). x float32 [M, E], attention float32 [M, A], M <= SWIGLU_MAX_ROWS. Returns [M, E]. The
    kernel must be loaded."""
    x, attention = x.contiguous(), attention.contiguous()
    rows, e = x.shape
    a = attention.shape[1]
    f = mlp[0][0].shape[0]
    o_threads = threads_for(rows * e * a)
    mlp_threads = swiglu_threads(rows, e, f)
    mid, normed, mlp_out, y = (torch.empty(rows, e, dtype=torch.float32) for _ in range(4))
    h = torch.empty(rows, f, dtype=torch.float32)
    first = [tensor.data_ptr() for tensor in (x, attention, *o_proj, norm_weight)]
    scratch = int16_scratch(rows, a, e, f)
    rest = [tensor.data_ptr() for tensor in (*mlp[0], *mlp[1], *mlp[2], mid, normed, mlp_out, h, *scratch, y)]
    _loaded().q4_1_attention_output_and_mlp(*first, eps, *rest, rows, a, e, f, o_threads, mlp_threads)
    return y


def q4_1_decode_layers(
    x: torch.Tensor,
    weights: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: list[int],
    window: int | None,
    num_heads: int,
    intermediate_size: int,
) -> None:
    """One decode step through every decoder layer in one C call (`csrc/gguf_gemv.c`,
    `q4_1_decode_layers`) over a KVCache: x float32 [B, E] (one new token per sequence, contiguous)
    goes through the layers in place; layer l writes its k, v at position held[l] of keys, values
    [L, B, H_kv, S_max, D] (contiguous; the caller advances the cache's lengths) and attends over the
    held[l] + 1 positions (the last `window` of them, None: all). weights int64 [L, 23]: each layer's
    addresses in `Q4DecoderLayer.c_weights`' order. cos, sin float32 [1, D] (the position every
    sequence is at). B <= SWIGLU_MAX_ROWS. The kernel must be loaded."""
    _, _, kv_heads, s_max, d = keys.shape
    held_tensor = torch.tensor(held, dtype=torch.int64)
    cache = [keys.data_ptr(), values.data_ptr(), held_tensor.data_ptr(), s_max, window or 0]
    _decode_step(
        "q4_1_decode_layers", x, weights, eps, cos, sin, cache, num_heads, kv_heads, d, intermediate_size, s_max
    )


def q4_1_decode_layers_paged(
    x: torch.Tensor,
    weights: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    window: int | None,
    num_heads: int,
    intermediate_size: int,
) -> None:
    """`q4_1_decode_layers` over the engine's paged store instead: keys, values [L, num_blocks,
    block_size, H_kv, D] (contiguous); sequence b writes its new k, v at slot slots[b] and attends over
    its lengths[b] keys (the new one included) through tables [B, max_blocks] of block ids; all int64.
    cos, sin float32 [B, D]: row b at sequence b's position."""
    _, num_blocks, block_size, kv_heads, d = keys.shape
    max_blocks = tables.shape[1]
    cache = [keys.data_ptr(), values.data_ptr(), num_blocks * block_size]
    cache += [tensor.data_ptr() for tensor in (tables, lengths, slots)] + [block_size, max_blocks, window or 0]
    context = max_blocks * block_size  # the padded table bounds the longest context
    _decode_step(
        "q4_1_decode_layers_paged", x, weights, eps, cos, sin, cache, num_heads, kv_heads, d, intermediate_size, context
    )


def _decode_step(
    function: str,
    x: torch.Tensor,
    weights: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: list[int],
    num_heads: int,
    kv_heads: int,
    d: int,
    intermediate_size: int,
    context: int,
) -> None:
    """The C decode step `function` with its cache's arguments `cache`, and its scratch for B = x's
    rows and up to `context` keys. The whole step is one parallel region (the team wakes once), so it
    gets the threads its whole work asks for (`thread_team.threads_for`, the SwiGLU's one-wake threshold)."""
    rows, e = x.shape
    f, a, kv = intermediate_size, num_heads * d, kv_heads * d
    work = rows * ((a + 2 * kv) * e + a * context + e * a + 3 * e * f)  # multiply-adds of one layer
    threads = thread_team.threads_for(work, SWIGLU_ONE_THREAD_BELOW)
    scratch = (
        _floats(rows, e),  # h: the normed input
        *int16_scratch(rows, e),
        _floats(rows, a),  # q
        _floats(rows, kv),  # k
        _floats(rows, kv),  # v
        _floats(rows, a),  # the attention's output
        _floats(threads, context),  # scores
        *(_floats(rows, e) for _ in range(3)),  # mid, normed, mlp
        _floats(rows, f),  # the MLP's hidden units
        *int16_scratch(rows, a, e, f),
    )
    getattr(_loaded(), function)(
        x.data_ptr(),
        weights.data_ptr(),
        weights.shape[0],
        eps,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        *cache,
        d**-0.5,
        *[tensor.data_ptr() for tensor in scratch],
        rows,
        e,
        f,
        num_heads,
        kv_heads,
        d,
        threads,
    )


def dequantizes_here(blocks: torch.Tensor) -> bool:
    """Can the C kernels dequantize `blocks` (a layer's block tensor)? On the CPU, with the kernels loaded."""
    return blocks.device.type == "cpu" and kernel() is not None


def _dequantized(function: str, n: int, k: int, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """W float32 [N, K] from the C dequantizer `function`(*blocks, W, N, K, threads)."""
    w = torch.empty(n, k, dtype=torch.float32)
    pointers = [tensor.data_ptr() for tensor in (*blocks, w)]
    getattr(_loaded(), function)(*pointers, n, k, torch.get_num_threads())
    return w


def q4_1_dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """qs uint8 [N, K/2], d and m float16 [N, K/32] (contiguous, CPU) -> W float32 [N, K], bit for
    bit `q4_linear.dequantize_q4_1`'s, in C. TypeError for blocks of other dtypes."""
    return _dequantized("q4_1_dequantize", qs.shape[0], qs.shape[1] * 2, q4_1_checked((qs, d, m)))


def q8_0_dequantize(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """qs int8 [N, K], d float32 [N, K/32] (contiguous, CPU) -> W float32 [N, K], bit for bit
    `q8_linear.dequantize_q8_0`'s, in C."""
    return _dequantized("q8_0_dequantize", qs.shape[0], qs.shape[1], (qs, d))
