"""decodelab.lessons.gpu_kernel: the Triton kernels give gather + SDPA's result (under Triton's
interpreter on a CPU, compiled on CUDA: the tests marked `cuda`, run by `make gpu-check`), the
oracles agree with each other and with the engine's gather, the inputs are checked, and the module
imports where triton is missing."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from decodelab.engine.paged_attention import gather_kv
from decodelab.lessons import gpu_kernel as gk

needs_triton = pytest.mark.skipif(gk.triton is None, reason="triton is not installed")


def _random_case(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pick = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))  # noqa: E731
    kv_heads, group, block_size = pick(1, 3), pick(1, 5), 2 ** pick(0, 4)
    lengths = [pick(1, 70) for _ in range(pick(1, 4))]
    return gk.random_paged_batch(
        lengths,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=2 ** pick(0, 5),
        block_size=block_size,
        seed=seed,
    )


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_gather_and_sdpa_on_random_shapes(seed):
    batch = _random_case(seed)
    torch.testing.assert_close(gk.paged_attention(**batch), gk.sdpa_by_gather(**batch), atol=1e-5, rtol=1e-5)


@needs_triton
def test_half_precision_keeps_its_dtype():
    batch = gk.random_paged_batch([33, 8], num_heads=6, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float16)
    got = gk.paged_attention(**batch)
    assert got.dtype == torch.float16
    want = gk.sdpa_by_gather(**{k: v.float() if v.is_floating_point() else v for k, v in batch.items()})
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@needs_triton
def test_gather_kernel_equals_the_engines_gather_and_leaves_the_padding_zero():
    batch = gk.random_paged_batch([21, 9, 30], num_kv_heads=3, head_dim=8, block_size=8, seed=5)
    cache, tables, lens = batch["key_cache"], batch["block_tables"], batch["context_lens"]
    got = gk.gather_kv_blocks(cache, tables, lens)
    flat = cache.reshape(-1, 3, 8)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(got[b, :, :n], gather_kv(flat, tables[b].tolist(), n, 8))
        assert not got[b, :, n:].any()


def test_the_two_gather_oracles_agree():
    """Per sequence through the engine's gather_kv, and batched with a padding mask (the engine's decode path)."""
    for seed in range(3):
        batch = _random_case(10 + seed)
        torch.testing.assert_close(gk.batched_sdpa_by_gather(**batch), gk.sdpa_by_gather(**batch), atol=1e-5, rtol=1e-5)


def test_random_batches_shuffle_the_pool_and_pad_with_other_blocks():
    batch = gk.random_paged_batch([17, 40, 3], block_size=8, seed=1)
    tables, lens = batch["block_tables"].tolist(), batch["context_lens"].tolist()
    num_blocks = batch["key_cache"].shape[0]
    owned = [table[: -(-n // 8)] for table, n in zip(tables, lens)]
    flat = [block for blocks in owned for block in blocks]
    assert len(flat) == len(set(flat)), "two sequences share a block"
    assert any(blocks != list(range(blocks[0], blocks[0] + len(blocks))) for blocks in owned), "tables in order"
    for table, blocks in zip(tables, owned):
        padding = table[len(blocks) :]
        assert all(0 <= p < num_blocks and p not in blocks for p in padding), (table, blocks)


def test_kv_bytes_read_counts_keys_and_values_once():
    assert gk.kv_bytes_read([4096] * 32, num_kv_heads=3, head_dim=64, bytes_per_value=2) == 2 * 32 * 4096 * 3 * 64 * 2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.update(key_cache=b["key_cache"][0]), r"key_cache must be \[num_blocks"),
        (lambda b: b.update(value_cache=b["value_cache"][:-1]), r"value_cache .* must have key_cache's shape"),
        (
            lambda b: b.update(context_lens=torch.tensor([0, 5], dtype=torch.int32)),
            r"context_lens must lie in 1 \.\. 24",
        ),
        (
            lambda b: b.update(context_lens=torch.tensor([25, 5], dtype=torch.int32)),
            r"context_lens must lie in 1 \.\. 24",
        ),
        (lambda b: b.update(block_tables=b["block_tables"] + 100), r"block ids in 0 \.\. 5"),
        (lambda b: b.update(block_tables=b["block_tables"].float()), r"must hold integers"),
        (lambda b: b.update(q=torch.randn(2, 3, 8)), r"the 3 query heads must be a multiple of the 2 KV heads"),
        (lambda b: b.update(q=b["q"][:1]), r"q must be \[B, H, D\]"),
    ],
)
def test_bad_input_is_named(change, message):
    batch = gk.random_paged_batch([20, 5], num_heads=4, num_kv_heads=2, head_dim=8, block_size=8, spare_blocks=2)
    change(batch)
    with pytest.raises(ValueError, match=message):
        gk.paged_attention(**batch)


def test_head_dimension_must_be_a_power_of_two():
    batch = gk.random_paged_batch([5], num_heads=2, num_kv_heads=1, head_dim=6, block_size=4)
    with pytest.raises(ValueError, match=r"head dimension D must be a power of two .* got 6"):
        gk.paged_attention(**batch)


@needs_triton
def test_an_exception_inside_a_kernel_comes_out_as_itself():
    """Under the interpreter Triton wraps it in an InterpreterError; `launch` hands the learner their own."""
    if not gk.interpreter_active():
        pytest.skip("compiled kernels cannot raise Python exceptions")

    @gk.triton.jit
    def unfinished(x_ptr, BLOCK: gk.tl.constexpr):
        raise NotImplementedError("write this function")

    with pytest.raises(NotImplementedError, match="write this function"):
        gk.launch(unfinished, (1,), torch.zeros(4), BLOCK=4)


@needs_triton
def test_a_plain_function_is_told_it_needs_triton_jit():
    def gather_kv_kernel(cache_ptr):
        pass

    with pytest.raises(TypeError, match=r"gather_kv_kernel is not a Triton kernel: put @triton.jit"):
        gk.launch(gather_kv_kernel, (1,), torch.zeros(4))


@needs_triton
def test_a_compiled_stub_reads_as_not_written_yet():
    """On a GPU, Triton cannot compile a body that raises; the learner reads what the interpreter says.
    (Compiling needs a GPU: a kernel stand-in raises what Triton's code generator raises there.)"""
    import ast

    from triton.compiler.errors import UnsupportedLanguageConstruct

    class CompiledStub:
        __name__ = "paged_attention_kernel"
        src = 'def paged_attention_kernel(q_ptr):\n    raise NotImplementedError("write this function")\n'

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                node = ast.parse(self.src).body[0].body[0]
                raise UnsupportedLanguageConstruct(self.src, node, "unsupported AST node type: Raise")

            return run

    with pytest.raises(NotImplementedError, match=r"paged_attention_kernel is not written yet"):
        gk.launch(CompiledStub(), (1,), torch.zeros(4))


def test_the_module_imports_without_triton():
    block = (
        "import importlib.abc, sys\n"
        "class NoTriton(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "from decodelab.lessons import gpu_kernel as gk\n"
        "import torch\n"
        "batch = gk.random_paged_batch([5], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)\n"
        "print(gk.triton is None, gk.sdpa_by_gather(**batch).shape)\n"
        "try:\n"
        "    gk.paged_attention(**batch)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = run.stdout.strip().splitlines()
    assert first == "True torch.Size([1, 2, 8])"
    assert second.startswith("triton is not installed: `pip install triton==3.6.0`")


# --------------------------------------------------------------------------- compiled, on a GPU (make gpu-check)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_compiled_kernel_matches_sdpa_on_cuda(dtype, tol):
    """SmolLM2's heads, blocks of 16, batch 32 with ragged contexts up to 4,096 tokens."""
    assert not gk.interpreter_active(), "with CUDA the kernels must be compiled"
    lengths = [1, 15, 16, 17, 4096] + [
        int(n) for n in torch.randint(1, 4097, (27,), generator=torch.Generator().manual_seed(0))
    ]
    batch = gk.random_paged_batch(lengths, device="cuda", dtype=dtype)
    got = gk.paged_attention(**batch)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), gk.batched_sdpa_by_gather(**batch).float(), atol=tol, rtol=tol)
    reference = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    torch.testing.assert_close(got.float(), gk.sdpa_by_gather(**reference), atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 1), (9, 3)])
def test_compiled_kernels_on_cuda_for_every_grouping(heads, kv_heads):
    batch = gk.random_paged_batch([100, 7, 33], num_heads=heads, num_kv_heads=kv_heads, head_dim=64, device="cuda")
    torch.testing.assert_close(gk.paged_attention(**batch), gk.sdpa_by_gather(**batch), atol=1e-4, rtol=1e-4)
    gathered = gk.gather_kv_blocks(batch["key_cache"], batch["block_tables"], batch["context_lens"])
    flat = batch["key_cache"].reshape(-1, kv_heads, 64)
    for b, n in enumerate(batch["context_lens"].tolist()):
        assert torch.equal(gathered[b, :, :n], gather_kv(flat, batch["block_tables"][b].tolist(), n, 16))
        assert not gathered[b, :, n:].any()
    assert math.isfinite(gathered.sum().item())


# --------------------------------------------------------------------------- the notebook's figures


def test_pool_figure_labels_each_token_in_its_slot():
    from decodelab.course.widgets.gpu_kernel import pool_figure

    batch = gk.random_paged_batch([21, 9], block_size=8, seed=2)
    table = batch["block_tables"][1].tolist()
    labels = pool_figure(batch["block_tables"], batch["context_lens"], batch["key_cache"].shape[0], 8).data[0].text
    assert labels[table[1]][0] == "s1:8" and labels[table[1]][1] == ""  # token 8 of 9, then the stale tail


def test_program_explorer_runs_the_given_attention_until_every_block_is_in():
    from decodelab.course.widgets.gpu_kernel import program_explorer

    calls = []

    def attention(**batch):  # the oracle stands in for a kernel: the explorer must use what it is given
        calls.append(batch["context_lens"].tolist())
        return gk.sdpa_by_gather(**batch)

    batch = gk.random_paged_batch([21, 9, 30], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    box = program_explorer(attention, batch)
    assert calls == [[21, 9, 30], [8]] and "1 of 3 blocks read" in box.figure.layout.title.text
    box.controls["sequence"].value = 2
    box.controls["step"].value = 4
    assert calls[-1] == [30] and "4 of 4 blocks read" in box.figure.layout.title.text
    assert max(box.figure.data[1].y) < 1e-6 and "every block is in" in box.figure.layout.title.text
    box.controls["step"].value = 2
    assert calls[-1] == [16] and min(box.figure.data[1].y) > 1e-3
