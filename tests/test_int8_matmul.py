"""int8_matmul.py: the W8A16 Triton kernel against the matmul with the dequantized weight, and
quantize.WeightOnlyInt8Linear choosing it on CUDA for several rows.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before anything imports triton). The interpreter has no bfloat16 tl.dot: bfloat16 is checked on
CUDA only.
"""
import pytest
import torch
import torch.nn as nn

from gpu_kernels import int8_matmul
import quantize

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not int8_matmul.INTERPRETED,
                                                 reason="the kernel is compiled for the GPU (no TRITON_INTERPRET)")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def case(M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight, scales = quantize.quantize_int8(torch.randn(N, K, generator=g))
    return torch.randn(M, K, generator=g), weight, scales


# rows: a draft level, a 60-node verify, two row blocks; sizes that are no multiple of any block
@pytest.mark.parametrize("M, N, K", [(2, 64, 128), (7, 100, 200), (60, 96, 256), (130, 40, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_kernel_equals_the_dequantized_matmul(M, N, K, dtype, device):
    x, weight, scales = case(M, N, K)
    x = x.to(dtype)
    expected = int8_matmul.reference(x, weight, scales)
    y = int8_matmul.int8_matmul(x.to(device), weight.to(device), scales.to(dtype).to(device))
    assert y.shape == (M, N) and y.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.cpu().float(), expected, atol=tol * expected.abs().max(), rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@torch.no_grad()
def test_launch_constants_are_read_at_every_call(device, dtype, monkeypatch):
    """A tuning sweep sets the module's launch constants: other values, same result."""
    for name in ("MAX_BLOCK_M", "FP32_MAX_BLOCK_M", "BLOCK_N"):
        monkeypatch.setattr(int8_matmul, name, 16)
    for name in ("BLOCK_K", "FP32_BLOCK_K"):
        monkeypatch.setattr(int8_matmul, name, 32)
    x, weight, scales = case(40, 50, 100, seed=1)
    assert int8_matmul.launch_config(40, dtype, 10**6)["BLOCK_M"] == 16  # 40 rows: three blocks
    y = int8_matmul.int8_matmul(x.to(device, dtype), weight.to(device), scales.to(device, dtype))
    expected = int8_matmul.reference(x.to(dtype), weight, scales.to(dtype))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.cpu().float(), expected, atol=tol * expected.abs().max(), rtol=tol)


@pytest.mark.parametrize("limit, block_k, stages", [(232448, 128, 4), (166912, 128, 4), (101376, 64, 4),
                                                    (30000, 32, 3), (12000, 32, 1)])
def test_launches_keep_within_the_shared_memory_limit(limit, block_k, stages):
    """128 rows of bfloat16 at the module's 128 x 128 x 4 stages would need 110,592 bytes on an
    RTX 3090 (sm_86: 101,376): shorter K steps first, then fewer stages, always within the bound."""
    launch = int8_matmul.launch_config(128, torch.bfloat16, limit)
    assert (launch["BLOCK_M"], launch["BLOCK_K"], launch["num_stages"]) == (128, block_k, stages)
    assert int8_matmul.shared_bytes(128, launch["BLOCK_N"], block_k, stages, 2) <= limit
    with pytest.raises(ValueError, match="no launch fits in 1000 bytes"):
        int8_matmul.launch_config(128, torch.bfloat16, 1000)


def test_a_dynamic_prefill_compiles_once_per_row_block(monkeypatch):
    """--compile_prefill traces with a symbolic row count. The row block is found by comparisons,
    which torch.compile guards as ranges: prompts of 2-128 rows take one graph per block size
    (16, 32, 64, 128), not one per length. The kernel is a stand-in here: what is checked is the
    host code under dynamo."""
    class Kernel:  # writes the launch's row block into y (argument 3): traced by dynamo like the host code
        def __getitem__(self, grid):
            return lambda *args, **kwargs: args[3].fill_(kwargs["BLOCK_M"])

    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(int8_matmul, "_int8_matmul_kernel", Kernel())
    monkeypatch.setattr(int8_matmul, "INTERPRETED", True)  # the host code's CUDA check: the stand-in runs anywhere
    torch._dynamo.reset()
    prefill = torch.compile(int8_matmul.int8_matmul, backend=count, dynamic=True, fullgraph=True)
    weight, scales = case(2, 64, 128)[1:]
    rows = [2, 3, 9, 16, 17, 31, 32, 33, 60, 64, 65, 100, 127, 128]
    blocks = [prefill(torch.randn(m, 128, dtype=torch.bfloat16), weight, scales.bfloat16())[0, 0].item() for m in rows]
    torch._dynamo.reset()
    assert blocks == [max(16, 1 << (m - 1).bit_length()) for m in rows]
    assert len(graphs) == 4


def test_bad_input_gets_a_clear_error():
    x, weight, scales = case(4, 8, 16)
    with pytest.raises(ValueError, match=r"x \[M, K\], weight \[N, K\] and scales \[N\]"):
        int8_matmul.int8_matmul(x[:, :8], weight, scales)
    with pytest.raises(ValueError, match="int8 weights"):
        int8_matmul.int8_matmul(x, weight.float(), scales)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_int8_linear_on_cuda_takes_the_kernel_for_several_rows(monkeypatch):
    calls = []
    real = quantize.int8_matmul
    monkeypatch.setattr(quantize, "int8_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(0)
    lin = nn.Linear(576, 960)
    layer = quantize.WeightOnlyInt8Linear.from_linear(lin).to("cuda", torch.bfloat16)
    deq = quantize.dequantize_int8(layer.weight, layer.scales).cpu()
    for rows in (1, 2, 60, quantize.CUDA_INT8_KERNEL_ROWS + 1):
        x = torch.randn(1, rows, 576)
        y = layer(x.cuda().bfloat16()).cpu().float()
        expected = x @ deq.t() + lin.bias
        torch.testing.assert_close(y, expected, atol=2e-2 * expected.abs().max(), rtol=2e-2)
    assert calls == [(2, 576), (60, 576)]  # one row and a prefill's many take the cast
