"""Must-show 2 (issue 10): random sampling with speculative decoding is lossless.

On a tiny random-weight Llama with a 12-token vocabulary, 20,000 completions per setting are sampled
through the engine with speculation on (drafts deliberately different from the target: a different
random draft model, n-gram lookup, the target's first layer). The joint distribution of the first two
sampled tokens and the marginal of the third are compared with the exact target distribution (from
transformers' float32 forward of every prefix, filtered by the sampler's own processing: penalties,
temperature, top-k/top-p/min-p) by a chi-square goodness-of-fit test. The first token comes from the
prefill step, the second and third from verification (first draft position, then second position or
the bonus token). The same test with a deliberately broken rejection rule (resample from p instead of
norm(max(p − q, 0)) after a rejection) must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams
from kvfleet_server.sample import rejection
from kvfleet_server.sample.sampler import SampleRow, filter_probs, process_logits

from tiny_models import _save_tiny
from engine_helpers import assert_all_blocks_free, run_to_completion

pytestmark = pytest.mark.slow

V = 12
PROMPT = [5, 7, 9, 5, 7, 9, 5, 7]
NUM_SAMPLES = 20_000
N_PER_REQUEST = 250
ALPHA = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory, hf_tokenizer_dir):
    target = _save_tiny("llama", str(tmp_path_factory.mktemp("t12")), hf_tokenizer_dir, vocab_size=V)
    draft = _save_tiny("llama", str(tmp_path_factory.mktemp("d12")), hf_tokenizer_dir, vocab_size=V,
                       hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return target, draft


SETTINGS = {
    "draft_model": (dict(temperature=1.0, top_p=0.9), lambda d: {"method": "draft_model", "model": d}),
    "ngram": (dict(temperature=0.8, top_k=6, frequency_penalty=0.5),
              lambda d: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    "layer_skip": (dict(temperature=1.2, min_p=0.05, repetition_penalty=1.3),
                   lambda d: {"method": "layer_skip", "num_draft_layers": 1}),
}


def _exact(target_dir: str, params: SamplingParams):
    """P(t1, t2) [V, V] and P(t3) [V] of the target under the sampler's processing."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].float()
        rows = [SampleRow(params, PROMPT, p, None, []) for p in prefixes]
        return filter_probs(process_logits(logits, rows), [params] * len(prefixes)).double()

    p1 = dist([[]])[0]
    p2 = dist([[a] for a in range(V)])  # [t1, t2]
    joint = p1[:, None] * p2
    p3 = dist([[a, b] for a, b in itertools.product(range(V), range(V))]).view(V, V, V)
    return joint, (joint[:, :, None] * p3).sum((0, 1))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    small = exp < 5
    e = torch.cat([exp[~small], exp[small].sum()[None]])
    o = torch.cat([obs[~small], obs[small].sum()[None]])
    keep = e > 0
    assert (o[~keep] == 0).all(), "a sample fell where the target has probability 0"
    stat = ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _sample(target_dir, spec, params_kw):
    eng = LLMEngine(EngineConfig(model=target_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20,
                                 max_num_seqs=N_PER_REQUEST * 2, seed=7,
                                 speculative_config={**spec, "num_speculative_tokens": 3,
                                                     "min_acceptance": 0}))  # always speculate
    counts12 = torch.zeros(V, V, dtype=torch.long)
    counts3 = torch.zeros(V, dtype=torch.long)
    drafted = accepted = 0
    for r in range(NUM_SAMPLES // N_PER_REQUEST):
        eng.add_request(f"r{r}", PROMPT, SamplingParams(n=N_PER_REQUEST, max_tokens=4, ignore_eos=True, **params_kw))

        def on_step(e):
            nonlocal drafted, accepted
            drafted += e.last_iteration.num_draft_tokens
            accepted += e.last_iteration.num_accepted_tokens

        for c in run_to_completion(eng, on_step=on_step)[f"r{r}"].outputs:
            t = c.token_ids
            counts12[t[0], t[1]] += 1
            counts3[t[2]] += 1
    assert_all_blocks_free(eng)
    assert drafted > NUM_SAMPLES and 0 < accepted < drafted  # verification decided most tokens
    return counts12, counts3


@pytest.mark.parametrize("method", list(SETTINGS))
def test_speculative_sampling_matches_target_distribution(models, method):
    target, draft = models
    kw, spec = SETTINGS[method]
    joint, p3 = _exact(target, SamplingParams(**kw))
    c12, c3 = _sample(target, spec(draft), kw)
    assert c12.sum() == NUM_SAMPLES
    p12, p3v = _chi2_pvalue(c12, joint), _chi2_pvalue(c3, p3)
    assert p12 > ALPHA and p3v > ALPHA, (p12, p3v)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_broken_rejection_rule_is_detected(models, method, monkeypatch):
    """Resampling from p after a rejection (a classic bug) biases towards the drafts: the test sees it."""
    target, draft = models
    kw, spec = SETTINGS[method]
    joint, p3 = _exact(target, SamplingParams(**kw))
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    c12, c3 = _sample(target, spec(draft), kw)
    assert min(_chi2_pvalue(c12, joint), _chi2_pvalue(c3, p3)) < ALPHA
