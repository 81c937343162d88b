"""research/aoti_packages.py's wrappers, eager on the tiny checkpoint (building a package takes minutes):
a round run through WithState equals the round itself, and its state is the tensors passed in."""
import pytest
import torch

import aoti_packages


@torch.no_grad()
def test_a_round_with_its_state_as_inputs_is_the_round(tiny_checkpoint, tmp_path):
    checkpoint, _ = tiny_checkpoint
    args = aoti_packages.parse_args(["--checkpoint_path", str(checkpoint), "--dir", str(tmp_path), "--context", "64"])
    model, spec, tokenizer, step, rnd = aoti_packages.setup(args)
    assert rnd.names and not any(n.rsplit(".", 1)[-1] in aoti_packages.NOT_STATE for n in rnd.names)
    assert any(n.endswith("kv_cache.k_cache") for n in step.names) and "inner.out" in rnd.names
    spec.prefill(aoti_packages.prompt_ids(tokenizer, "Rivers."), 16)
    buffers = dict(rnd.module.named_buffers())
    before = {n: buffers[n].clone() for n in rnd.names}
    spec.round()
    after = {n: buffers[n].clone() for n in rnd.names}
    for n in rnd.names:  # back to the state before the round
        buffers[n].copy_(before[n])
    dummy = torch.zeros(1, dtype=torch.long)
    copies = [before[n].clone() for n in rnd.names]
    rnd(dummy, *copies)  # a round on copies of the state: the module's own buffers stay as they were
    assert all(torch.equal(buffers[n], before[n]) for n in rnd.names)
    assert all(torch.equal(c, after[n]) for c, n in zip(copies, rnd.names))
    assert not torch.equal(after["inner.n_out"], before["inner.n_out"])  # the round did emit
    rnd(dummy, *rnd.state())  # on the module's own tensors, views of the KV block included
    assert all(torch.equal(buffers[n], after[n]) for n in rnd.names)
