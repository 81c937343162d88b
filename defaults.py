"""The defaults of a run, in one table, keyed on what a library reports about the machine: the device, whether the
run is compiled, and whether the CPU has AMX tiles. Where no reported capability separates machines that measured
apart, a row takes the default that is the same on every CPU of its kind (bfloat16 is the compiled CPU dtype
everywhere: benchmarks/RESULTS.md, "CPU dtype")."""
from typing import NamedTuple, Optional

import torch

from quantize import INDUCTOR_INT4_ROWS_INVARIANT, INDUCTOR_INT8_ROWS_INVARIANT


class Row(NamedTuple):
    device: str
    compiled: Optional[bool]  # None: either
    amx: Optional[bool]       # torch.cpu._is_amx_tile_supported(); None: either
    dtype: str
    tree: object              # (top_k, depth, tokens) of eagle2's dynamic tree, or "auto" (autoshape.py measures)
    lookup: int               # prompt lookup's guesses added to every tree
    invariant: bool           # batch-invariant mode: on where it costs at most 10 % of a round
    why: str                  # the sections of benchmarks/RESULTS.md whose measurements chose the row


TABLE = [
    #   device  compiled  AMX    dtype       tree          lookup  invariant  why
    Row("cuda", None,     None,  "bfloat16", (10, 6, 60),  8,      False,     "GPU; Batch-invariant cost"),
    Row("cpu",  True,     True,  "bfloat16", (8, 3, 12),   8,      False,     "CPU tree size; Batch-invariant cost"),
    Row("cpu",  True,     False, "bfloat16", (4, 3, 4),    0,      True,      "CPU tree size; Batch-invariant cost; CPU dtype"),
    Row("cpu",  False,    None,  "float32",  "auto",       8,      False,     "CPU dtype"),
]
EAGLE3_DEPTH = 8   # eagle3's tree depth where the row's tree is eagle2's (10, 6, 60), as in the EAGLE-3 paper
LOOKUP_ALONE = 10  # --speculate lookup: guesses a round (transformers' prompt_lookup_num_tokens)
LOOKUP_STATIC = 8  # --speculate eagle: lookup nodes below EAGLE-1's static tree, on every device


def compile_by_default(device: str, tensor_parallel: bool) -> bool:
    """On a CPU, compiled (frozen weights and Inductor's C++ GEMM templates: RESULTS.md, "CPU dtype");
    on CUDA eager unless asked, as in gpt-fast; under torchrun eager (each rank compiles alike only
    without kernel timing)."""
    return device == "cpu" and not tensor_parallel


def row(device: str, compiled: bool) -> Row:
    """The row of TABLE that holds for this run on this machine."""
    kind = "cuda" if device.startswith("cuda") else device
    amx = kind == "cpu" and torch.cpu._is_amx_tile_supported()
    for r in TABLE:
        if r.device == kind and r.compiled in (None, compiled) and r.amx in (None, amx):
            return r
    return Row(kind, None, None, "float32", (10, 6, 60), 8, False, "")  # another device: the papers' tree


def tree(r: Row, speculate: str):
    """The row's tree for --speculate speculate (eagle3 deepens the GPU tree, as its paper does)."""
    return (10, EAGLE3_DEPTH, 60) if speculate == "eagle3" and r.tree == (10, 6, 60) else r.tree


def lookup(r: Row, speculate: str) -> int:
    """The row's lookup nodes are for dynamic trees; eagle's static tree always takes LOOKUP_STATIC."""
    return {"none": 0, "lookup": LOOKUP_ALONE, "eagle": LOOKUP_STATIC}.get(speculate, r.lookup)


def invariant(r: Row, quantized: Optional[str]) -> bool:
    """The row's batch-invariant default for a file (quantized: None, "int8" or "int4"): quantized
    files only where Inductor's templates keep their rows invariant (quantize.py)."""
    return r.invariant and (quantized is None or quantized == "int8" and INDUCTOR_INT8_ROWS_INVARIANT
                            or quantized == "int4" and INDUCTOR_INT4_ROWS_INVARIANT)
