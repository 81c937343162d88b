"""Whether the compiled CPU graphs can be AOTInductor packages that a later process loads in a second,
instead of re-tracing them from Inductor's cache on every start (benchmarks/RESULTS.md, "Start-up").

    python research/aoti_packages.py --dir /tmp/packages --out /tmp/aoti_packages

Builds two packages with generate.py's CPU Inductor settings (batch-invariant bf16, the default on CPUs
without AMX): the plain decode step and a Speculator's round. Then a fresh process loads them and decodes
--prompts with each: plain decoding with the step package, EAGLE-3 with the round package (the plain
step, flush and prefill eager), timing the loads, a step and a round. In the mode a round's tokens equal
plain decoding's, so the two answers must be identical. --against_compiled: the round compiled in that
process too, its tokens and (alternating) time beside the package's. Writes OUT.json.

What makes a graph exportable: its mutable state (KV caches, the Speculator's buffers) goes in as
inputs that the package updates in place, so the caller's tensors are the state, views included. As
module buffers instead, torch.export refuses the caches (views of one block), and a round package
bound to them (load_constants(user_managed=True)) computes wrong trees.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_round as pr  # noqa: E402  (its imports put the project on the path)
from profile_round import compiling, gen, invariant, load_draft, load_model, load_tokenizer, speculative  # noqa: E402

# Buffers that are not state: constants the package keeps (stop ids, RoPE tables, the draft's vocabulary)
# and the block the KV caches are views of (the graph reads and writes the views).
NOT_STATE = ("stop_ids", "kv_storage", "rope_cos", "rope_sin", "vocab")


def state_names(module: nn.Module) -> list:
    return [n for n, _ in module.named_buffers() if n.rsplit(".", 1)[-1] not in NOT_STATE]


class WithState(nn.Module):
    """fn(module, *args) with module's state buffers taken from the trailing inputs."""

    def __init__(self, module: nn.Module, fn, n_args: int):
        super().__init__()
        self.module, self.fn, self.n_args, self.names = module, fn, n_args, state_names(module)

    def state(self) -> list:
        """The module's own state tensors, in the order forward takes them."""
        buffers = dict(self.module.named_buffers())
        return [buffers[n] for n in self.names]

    def forward(self, *inputs):
        args, state = inputs[:self.n_args], inputs[self.n_args:]
        return functional_call(self.module, dict(zip(self.names, state)), args, {"fn": self.fn}, strict=False)


class Call(nn.Module):
    """A module whose forward is fn(inner, *args): what functional_call needs to reach a function."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, fn):
        return fn(self.inner, *args)


def greedy_step(model, token, input_pos):
    return gen.decode_one_token(model, token, input_pos, 0.0, None, None)


def round_fn(spec, dummy):
    """A round, with a tensor in and out: what torch.export takes and gives."""
    spec.round()
    return spec.n_out + dummy


def setup(args):
    model = load_model(args.checkpoint_path, "cpu", torch.bfloat16)
    invariant.enable(model)
    draft = load_draft(args.checkpoint_path.parent / "eagle3", model.config, "cpu", torch.bfloat16, arch="eagle3")
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    k, d, t = args.tree
    spec = speculative.Speculator(model, draft, tree_top_k=k, tree_depth=d, tree_tokens=t, stop_ids=tokenizer.stop_ids)
    spec.setup(1, args.context)
    step, rnd = Call(model), Call(spec)
    return model, spec, tokenizer, WithState(step, greedy_step, 2), WithState(rnd, round_fn, 1)


def prompt_ids(tokenizer, text):
    return torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])])


@torch.no_grad()
def build(args):
    model, spec, tokenizer, step, rnd = setup(args)
    spec.prefill(prompt_ids(tokenizer, args.prompts[0]), args.max_new_tokens)  # eager: the mode's probes answer
    spec.round()
    spec.plain_step()
    settings = dict(compiling.CPU_INDUCTOR, **compiling.CPU_INVARIANT)
    for key in ("cpp_wrapper", "fx_graph_cache"):  # a package is C++ and has no FX cache
        settings.pop(key)
    seconds = {}
    token, pos, dummy = torch.zeros(1, dtype=torch.long), torch.tensor([8]), torch.zeros(1, dtype=torch.long)
    for name, wrapper, example in (("step", step, (token, pos)), ("round", rnd, (dummy,))):
        state = tuple(t.clone() for t in wrapper.state())
        t = time.perf_counter()
        exported = torch.export.export(wrapper.eval(), example + state, strict=False)
        with torch.backends.mkldnn.flags(enabled=False):  # as compiling.cpu_backend: packed weights stay plain
            torch._inductor.aoti_compile_and_package(exported, package_path=str(args.dir / f"{name}.pt2"),
                                                     inductor_configs=settings)
        seconds[name] = time.perf_counter() - t
    return seconds


@torch.no_grad()
def load_and_decode(args):
    t = time.perf_counter()
    model, spec, tokenizer, step, rnd = setup(args)
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    step_pkg = torch._inductor.aoti_load_package(str(args.dir / "step.pt2"))
    round_pkg = torch._inductor.aoti_load_package(str(args.dir / "round.pt2"))
    load_s = time.perf_counter() - t
    step_state, round_state = step.state(), rnd.state()
    dummy = torch.zeros(1, dtype=torch.long)
    step_ms, round_ms, answers = [], [], []

    def packaged_step(m, token, input_pos, *_):
        t = time.perf_counter()
        out = step_pkg(token, input_pos, *step_state)
        step_ms.append((time.perf_counter() - t) * 1e3)
        return out

    def packaged_round():
        t = time.perf_counter()
        round_pkg(dummy, *round_state)
        round_ms.append((time.perf_counter() - t) * 1e3)

    for text in args.prompts:
        prompt = prompt_ids(tokenizer, text)
        model.setup_caches(1, args.context)
        plain = gen.generate(model, prompt, args.max_new_tokens, stop_ids=tokenizer.stop_ids, decode_fn=packaged_step)[0]
        spec.setup(1, args.context)
        ids, emitted = speculative.speculative_generate(spec, prompt, args.max_new_tokens, round_fn=packaged_round)
        answers.append(dict(prompt_tokens=prompt.size(1), plain=plain, speculative=ids[0], identical=plain == ids[0],
                            tau=sum(emitted[0]) / max(1, len(emitted[0]))))
    report = dict(setup_s=setup_s, load_s=load_s, step_ms=statistics.median(step_ms),
                  round_ms=statistics.median(round_ms), answers=answers)
    if args.against_compiled:  # the round compiled in this process as generate.py compiles it, alternating
        compiled = compiling.compile_function(spec.round, "cpu", (model, spec.draft), options=compiling.ROUND_OPTIONS)
        prompt = prompt_ids(tokenizer, args.prompts[0])
        t = time.perf_counter()
        ids, _ = speculative.speculative_generate(spec, prompt, args.max_new_tokens, round_fn=compiled)
        report.update(compile_s=time.perf_counter() - t, compiled_identical=ids[0] == answers[0]["speculative"])
        seconds = {"package": [], "compiled": []}
        for _ in range(6):
            for name, fn in (("package", lambda: round_pkg(dummy, *round_state)), ("compiled", compiled)):
                spec.prefill(prompt, args.max_new_tokens)
                for _ in range(8):
                    t = time.perf_counter()
                    fn()
                    seconds[name].append(time.perf_counter() - t)
        report["alternating_round_ms"] = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"))
    p.add_argument("--tree", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 3, 4),
                   help="top_k,depth,tokens (default: the CPU default, 4,3,4)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--prompts", nargs="+", default=["Name three rivers in Europe.", pr.PROMPTS[1]])
    p.add_argument("--dir", type=Path, required=True, help="where the packages go")
    p.add_argument("--out", type=Path, help="OUT.json: the report")
    p.add_argument("--against_compiled", action="store_true",
                   help="also compile the round in-process (minutes): its tokens and, alternating, its time")
    p.add_argument("--load_only", action="store_true", help="(the fresh process) load and decode")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.load_only:
        print(json.dumps(load_and_decode(args)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    report = dict(pr.run_header("aoti_packages.py", argv), tree=args.tree, build_s=build(args))
    argv_load = list(argv if argv is not None else sys.argv[1:]) + ["--load_only"]
    t = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, *argv_load], capture_output=True, text=True, check=True)
    report.update(json.loads(out.stdout.strip().splitlines()[-1]), fresh_process_s=time.perf_counter() - t)
    print(json.dumps({k: v for k, v in report.items() if k != "answers"}, indent=1))
    print("identical:", [a["identical"] for a in report["answers"]])
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
