"""compiling.py on a CPU: frozen graphs in Inductor's on-disk cache keyed by the weights, the guards
a frozen graph keeps, and a clear message where this torch lacks a setting."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import compiling
import generate as gen
from conftest import ROOT, tiny_target


CACHED_STEP = """
import json, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import compiling, generate as gen
from conftest import tiny_target
from torch._dynamo.utils import counters
compiling.CPU_INDUCTOR = dict(compiling.CPU_INDUCTOR, max_autotune=False)  # freezing is what matters here
model = tiny_target("tiny-llama", seed=int(sys.argv[1])).eval()
prompt = torch.arange(1, 9)[None]
with torch.no_grad():
    model.setup_caches(1, 40)
    eager = gen.generate(model, prompt, 24)[0]
    step = compiling.compile_function(gen.decode_one_token, "cpu", (model,))
    compiled = gen.generate(model, prompt, 24, decode_fn=step)[0]
print(json.dumps(dict(eager=eager, compiled=compiled, **{{k: v for k, v in counters["inductor"].items()
                                                         if k.startswith("fxgraph_cache")}})))
"""


def test_a_second_process_loads_the_frozen_graph_from_the_cache(tmp_path):
    """Frozen CPU graphs go to Inductor's on-disk cache (no oneDNN tensors in them) keyed by the
    weights: a second process with the same weights compiles nothing (a cache hit, no miss, no
    bypass); one with other weights of the same shapes compiles its own graph and decodes with its
    own weights, not with the packed copies of the first (Inductor keys frozen weights by shape)."""
    script = tmp_path / "step.py"
    script.write_text(CACHED_STEP.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def run(seed):
        out = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second, other = run(0), run(0), run(1)
    assert first["compiled"] == first["eager"] and first.get("fxgraph_cache_miss") == 1
    assert "fxgraph_cache_bypass" not in first  # the graph could be stored
    assert second.get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second
    assert second["compiled"] == first["compiled"]
    assert other.get("fxgraph_cache_miss") == 1 and other["compiled"] == other["eager"] != first["eager"]


@torch.no_grad()
def test_a_frozen_graph_keeps_the_guards_on_buffers_and_recompiles_for_a_grown_cache():
    """compiling.frozen_graph_guards drops dynamo's guards inside submodules but for their
    buffers: a step compiled over a 40-slot cache, then run after setup_caches grew every layer's
    cache to 80 slots, recompiles (the caches are buffers) and decodes eager's tokens past slot 40;
    a guard on a layer's parameter or hook dict is dropped, one on the model's own attributes kept."""
    model = tiny_target("tiny-llama", seed=3).eval()
    step = compiling.compile_function(gen.decode_one_token, "cpu", (model,))
    model.setup_caches(1, 40)
    short = torch.arange(1, 9)[None]
    assert gen.generate(model, short, 24, decode_fn=step) == gen.generate(model, short, 24)
    model.setup_caches(1, 80)
    long = torch.arange(1, 31)[None]
    assert gen.generate(model, long, 40, decode_fn=step) == gen.generate(model, long, 40)
    names = ["L['model']._modules['layers']._modules['0']._modules['attention']._modules['wqkv']._parameters['weight']",
             "L['model']._modules['layers']._modules['0']._modules['attention']._forward_hooks",
             "L['model']._modules['layers']._modules['0']._modules['attention']._modules['kv_cache']._buffers['k_cache']",
             "L['model']._buffers['kv_storage']", "L['model'].invariant_window", "L['token']"]
    entries = [types.SimpleNamespace(name=name) for name in names]
    assert compiling.frozen_graph_guards(entries) == [False, False, True, True, True, True]


def test_a_torch_without_a_cpu_compile_setting_gets_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compiling, "CPU_COMPILE_NEEDS",
                        compiling.CPU_COMPILE_NEEDS + (("torch._inductor.config", "no_such_setting"),))
    assert compiling.missing_cpu_compile_settings() == ["torch._inductor.config.no_such_setting"]
    with pytest.raises(RuntimeError, match="torch._inductor.config.no_such_setting, which torch"):
        compiling.compile_function(gen.decode_one_token, "cpu", (tiny_target(),))
    checkpoint_path = tmp_path / "tiny-llama" / "model.pth"
    checkpoint_path.parent.mkdir()
    checkpoint_path.write_bytes(b"")
    with pytest.raises(SystemExit):
        gen.parse_args(["--checkpoint_path", str(checkpoint_path), "--compile", "--device", "cpu"])
    assert "--compile on a CPU needs torch._inductor.config.no_such_setting" in capsys.readouterr().err


def test_gemm_templates_render_from_one_compiled_template_per_source():
    """compiling.render_templates_from_cache: Inductor's KernelTemplate turns a source into a jinja2
    Template once (the same object for the same source, asked again), and it renders what a
    Template made afresh renders; applied twice, it wraps the method once."""
    from torch._inductor.codegen.common import KernelTemplate
    compiling.render_templates_from_cache()
    compiling.render_templates_from_cache()
    method = KernelTemplate.__dict__["_template_from_string"].__func__
    assert hasattr(method, "cache_info") and not hasattr(method.__wrapped__, "cache_info")
    source = "{% for i in range(n) %}x[{{i}}] = {{ value }};\n{% endfor %}"
    first = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is first
    assert first.render(n=3, value=2) == method.__wrapped__(source).render(n=3, value=2) == \
        "x[0] = 2;\nx[1] = 2;\nx[2] = 2;\n"
