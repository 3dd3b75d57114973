"""Prepacked float32 linears on the CPU (model/layers/cpu_prepack.py: kvfleet's panels, oneDNN's layout
without the C++ kernels): which layers are packed, that the layer output matches F.linear within float32
rounding in both layouts, and that whole engine runs produce the same greedy tokens with and without
prepacking (the tiny model, and the real SmolLM2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfleet_server.model.layers.cpu_prepack import (
    PanelLinearMethod,
    PrepackedLinearMethod,
    packed_method,
    prepack_linears,
)
from kvfleet_server.model.layers.linear import Linear
from kvfleet_server.model.layers.quant import model_weight_bytes

pytestmark = pytest.mark.skipif(packed_method() is None, reason="no packed layout runs here")


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (5, 576, 1536), (37, 128, 40), (300, 96, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", [PanelLinearMethod, PrepackedLinearMethod])
def test_prepacked_linear_matches_f_linear(m, k, n, bias, method):
    if method is PanelLinearMethod and packed_method() is not PanelLinearMethod:
        pytest.skip("kvfleet's CPU kernels cannot be built here")
    if method is PrepackedLinearMethod and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    g = torch.Generator().manual_seed(m + k)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g)
    ref = F.linear(x, lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone())
    holder = torch.nn.Sequential(lin)
    assert prepack_linears(holder, method) == (1, 0)
    assert type(lin.quant_method) is method and lin.weight is None
    assert torch.allclose(lin(x), ref, rtol=1e-5, atol=1e-5)


def test_only_own_float32_unquantized_weights_are_packed(tiny_engine_factory):
    """The tiny Llama (untied head): every decoder projection and the LM head are packed; the
    embedding stays; the weight bytes reported are unchanged. A tied head (SmolLM2) is the embedding's
    weight: test_real_model_greedy_tokens_equal_with_and_without_prepack runs it."""
    eng = tiny_engine_factory(cpu_weight_prepack=False)
    model = eng.model
    before = model_weight_bytes(model)
    linears = [m for m in model.modules() if type(m) is Linear]
    assert model.lm_head in linears and len(linears) == 1 + 4 * len(model.layers)  # qkv, o, gate_up, down
    assert prepack_linears(model) == (len(linears), 0)
    assert model_weight_bytes(model) == before
    assert model.embed_tokens.weight is not None  # the embedding (a Linear subclass) looks rows up


def test_engine_default_prepacks_and_knob_turns_it_off(tiny_engine_factory):
    on, off = tiny_engine_factory(), tiny_engine_factory(cpu_weight_prepack=False)
    kinds = {type(m.quant_method).__name__ for m in on.model.modules() if type(m) is Linear}
    assert kinds == {packed_method().__name__}
    assert not any(isinstance(m.quant_method, PrepackedLinearMethod)
                   for m in off.model.modules() if isinstance(m, Linear))
    compiled = tiny_engine_factory(compilation_config={"level": 3})  # Inductor traces the plain layers
    assert not any(isinstance(m.quant_method, PrepackedLinearMethod)
                   for m in compiled.model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("kw", [{"quantization": "int8"}, {"quantization": "fp8"}, {"dtype": "bfloat16"}])
def test_quantized_and_bf16_linears_are_left_alone(tiny_engine_factory, kw):
    """Quantized projections keep their method (only the float32 LM head, which quantization keeps in the
    model dtype, is packed); bfloat16 weights are not packed."""
    eng = tiny_engine_factory(**kw)
    packed = [m for m in eng.model.modules() if isinstance(m, Linear)
              and isinstance(m.quant_method, PrepackedLinearMethod)]
    assert packed == ([] if "dtype" in kw else [eng.model.lm_head])
    assert all(m.quant_method.name == kw.get("quantization", "unquantized")
               for layer in eng.model.layers for m in layer.modules() if isinstance(m, Linear))
    assert prepack_linears(eng.model) == (0, 0)


def test_tiny_engine_greedy_tokens_equal_with_and_without_prepack(tiny_llama_dir):
    from kvfleet_server import LLM, SamplingParams

    prompts = [[3 + (i * 11 + j) % 60 for j in range(n)] for i, n in enumerate((4, 19, 33, 8))]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = [[r.outputs[0].token_ids for r in LLM(model=tiny_llama_dir, dtype="float32", device="cpu",
                                                 kv_cache_memory_bytes=2 << 20, cpu_weight_prepack=flag,
                                                 max_num_batched_tokens=24).generate(prompts, sp)]
            for flag in (False, True)]
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_real_model_greedy_tokens_equal_with_and_without_prepack(gguf_path):
    """The bundled SmolLM2 in float32 (tied LM head: a packed copy projects the logits, the float
    embedding serves row lookups): 8 prompts × 24 greedy tokens identical with and without prepacking."""
    from kvfleet_server import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
               "Water boils at", "The opposite of hot is", "import numpy as np\n", "Translate to French: cat"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for flag in (False, True):
        llm = LLM(model=gguf_path, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
                  cpu_weight_prepack=flag)
        packed = [m for m in llm.engine.model.modules() if isinstance(getattr(m, "quant_method", None),
                                                                       PrepackedLinearMethod)]
        assert len(packed) == (4 * len(llm.engine.model.layers) + 1 if flag else 0)
        if flag:
            assert llm.engine.model.embed_tokens.weight is not None
        outs[flag] = [r.outputs[0].token_ids for r in llm.generate(prompts, sp)]
    assert outs[True] == outs[False]
