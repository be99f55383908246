"""``lm_precision fp32-ort`` (cosyvoice_triton.models.lm_ort): the LM's trunk Linear layers on onnxruntime's fp32
MatMul give fp32's log-probabilities and tokens, on the LM oracle's tiny ``llm.pt``, one request at a time, in a
batch, live, in the served LM engine and TTS service, and through the served config.

The bar on log-probabilities (:data:`TOP_BAR`, :data:`TAIL_BAR`): at every step, the absolute difference of the
log-probabilities of fp32's top :data:`TOP_K` tokens (the sampling's ``top_k``) is at most 1e-5, and over the whole
vector the difference is at most 1e-5 relative (``|a - b| <= 1e-5 * max(1, |a|)``: the tail sits near -25, where
one float32 step is 1.9e-6). Measured at tiny dims: top tokens 6.2e-6, whole vector 1.1e-5 absolute (a tail token);
fp32 itself differs from the official code's log-probabilities by up to 6.7e-6 on the same cases.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import types

import numpy as np
import pytest
import torch
from conftest import PATIENCE_S
from lm_oracle import ORACLE, CountedDraws, oracle_cases, oracle_config, tts_request

from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.models import lm_ort, lm_quant
from cosyvoice_triton.models.llm import LMRequest, load_llm

TOP_K, TOP_BAR, TAIL_BAR = 25, 1e-5, 1e-5
#: the largest differences seen by the tests of this module (printed at the end: ``pytest -s``)
SEEN = {"top": 0.0, "vector": 0.0}
CASES = oracle_cases()


@pytest.fixture(scope="module")
def fp32():
    return load_llm(ORACLE, oracle_config())


@pytest.fixture(scope="module")
def ort():
    return load_llm(ORACLE, oracle_config(), precision="fp32-ort")


def _check_logp(ref: torch.Tensor, got: torch.Tensor, where: str) -> None:
    """``ref`` / ``got``: [steps, V] or [V] log-probabilities, against the module's bar."""
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    assert ref.shape == got.shape, where
    diff = (ref - got).abs()
    top = float(diff.gather(1, ref.topk(TOP_K, dim=-1).indices).max())
    rel = float((diff / ref.abs().clamp(min=1.0)).max())
    SEEN["top"], SEEN["vector"] = max(SEEN["top"], top), max(SEEN["vector"], float(diff.max()))
    assert top <= TOP_BAR, f"{where}: top-{TOP_K} log-probs differ by {top:.2e}"
    assert rel <= TAIL_BAR, f"{where}: log-probs differ by {rel:.2e} relative"


# ------------------------------------------------------------------------------------------- the kernel


def test_kernel_computes_the_linear_and_holds_its_weights_once():
    g = np.random.default_rng(1)
    w = (g.standard_normal((96, 64)) / 8).astype(np.float32)
    b = g.standard_normal(96).astype(np.float32)
    for bias in (b, None):
        k = lm_ort.OrtKernel(w, bias, threads=1)
        for rows in (1, 5, 40):
            x = g.standard_normal((rows, 64)).astype(np.float32)
            ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if bias is None else bias)
            y = k(x)
            assert y.shape == ref.shape and y.dtype == np.float32
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        # onnxruntime packed the weight at creation: the kernel's own copy was freed (the module's memory claim)
        assert not k.holds_weight_copy
    assert lm_ort.OrtKernel(w, b, threads=2)(x).shape == (40, 96)


def test_a_session_that_reads_the_weight_keeps_it(monkeypatch):
    """Were a session to read the array it was given (onnxruntime 1.32 copies or packs it at creation; a stand-in
    session here reads it), the kernel keeps the array: the results stay right."""
    import onnxruntime

    given = []
    real_value = onnxruntime.OrtValue.ortvalue_from_numpy

    class Reading:
        def __init__(self, *args, **kwargs):
            self.w = given[-1]

        def run(self, names, feeds):
            return [feeds["x"] @ self.w]

    def capture(array, *args):
        given.append(array)
        return real_value(array, *args)

    monkeypatch.setattr(onnxruntime.OrtValue, "ortvalue_from_numpy", staticmethod(capture))
    monkeypatch.setattr(onnxruntime, "InferenceSession", Reading)
    g = np.random.default_rng(2)
    w = g.standard_normal((48, 32)).astype(np.float32)
    k = lm_ort.OrtKernel(w, None)
    assert k.holds_weight_copy
    x = g.standard_normal((3, 32)).astype(np.float32)
    # not bit for bit: BLAS may take another kernel for w.T than for the session's contiguous copy (AMX machines do)
    np.testing.assert_allclose(k(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_bad_kernel_arguments():
    with pytest.raises(ValueError, match="threads"):
        lm_ort.OrtKernel(np.zeros((2, 2), np.float32), threads=0)
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        lm_ort.OrtKernel(np.zeros(4, np.float32))


# ---------------------------------------------------------------------------------------------- the LM


def test_fp32_ort_swaps_the_trunk_linears_only(ort):
    layer = ort.qwen.layers[0]
    for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
              layer.mlp.down_proj):
        assert isinstance(m, lm_ort.OrtLinear)
    assert layer.self_attn.q_proj.has_bias and not layer.self_attn.o_proj.has_bias
    assert not any(type(m) is torch.nn.Linear for m in ort.qwen.modules())
    assert type(ort.llm_decoder) is torch.nn.Linear  # the speech head stays PyTorch
    assert ort.lm_precision == "fp32-ort" and ort.lm_threads == torch.get_num_threads()
    assert "fp32-ort" in lm_quant.LM_PRECISIONS


def test_threads_and_devices():
    lm = load_llm(ORACLE, oracle_config(), precision="fp32-ort", threads=1)
    assert lm.lm_threads == 1 and lm.qwen.layers[0].mlp.up_proj.run.threads == 1
    on_gpu = types.SimpleNamespace(llm_decoder=types.SimpleNamespace(weight=torch.empty(0, device="meta")))
    with pytest.raises(ConfigError, match="fp32-ort is onnxruntime's CPU MatMul"):
        lm_ort.ort_lm(on_gpu)
    with pytest.raises(ConfigError, match="lm_precision must be one of fp32, int8, fp32-ort"):
        load_llm(ORACLE, oracle_config(), precision="fp16")


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_and_cached_steps_equal_fp32(fp32, ort, name):
    """Teacher-forced on the oracle's tokens: the prompt prefilled in one call, then one token per call with the
    KV cache (17 to 61 steps per case)."""
    z = CASES[name]
    args = (z["text"], z["prompt_text"], z["prompt_speech_token"], z["tokens"].tolist())
    ref, got = lm_quant.teacher_forced_logp(fp32, *args), lm_quant.teacher_forced_logp(ort, *args)
    assert ref.shape[0] == len(z["tokens"]) + 1
    _check_logp(ref[:1], got[:1], f"{name}: prefill")
    _check_logp(ref[1:], got[1:], f"{name}: cached steps")


def _generate(lm, z, logps: list):
    draw = CountedDraws(z["draws"].tolist())
    stream = lm.generate(z["text"], z["prompt_text"], z["prompt_speech_token"], draws=draw,
                         on_step=lambda step, logp: logps.append(logp))
    return list(stream), draw.used


@pytest.mark.parametrize("name", ["zero_shot_b", "zero_shot_short", "cross_lingual"])
def test_batch_1_decode_equals_fp32_and_the_official_tokens(fp32, ort, name):
    """The decoding loop at batch 1 (BatchDecoder, sampling its own tokens with the oracle's injected draws):
    fp32's log-probabilities at every step, the official tokens, the same number of draws."""
    z = CASES[name]
    ref_logp, got_logp = [], []
    ref_tokens, ref_used = _generate(fp32, z, ref_logp)
    tokens, used = _generate(ort, z, got_logp)
    assert len(tokens) >= 30 or name == "cross_lingual"
    assert tokens == ref_tokens == z["tokens"].tolist() and used == ref_used == int(z["draws_used"])
    _check_logp(torch.stack(ref_logp), torch.stack(got_logp), name)


def _batch_logps(lm, names, max_batch):
    logps = {n: [] for n in names}
    requests = [LMRequest(CASES[n]["text"], CASES[n]["prompt_text"], CASES[n]["prompt_speech_token"],
                          draws=CASES[n]["draws"].tolist(),
                          on_step=lambda step, logp, n=n: logps[n].append(logp)) for n in names]
    return lm.generate_batch(requests, max_batch=max_batch), logps


@pytest.mark.parametrize("max_batch", [None, 2])
def test_batched_decode_equals_fp32_and_the_official_tokens(fp32, ort, max_batch):
    """Five requests of different lengths decoded together (left-padded cache, key mask, rows leaving; with
    ``max_batch`` 2 rows join as others leave): per request, fp32's log-probabilities at every step and the
    official tokens."""
    names = sorted(CASES)
    ref_tokens, ref = _batch_logps(fp32, names, max_batch)
    tokens, got = _batch_logps(ort, names, max_batch)
    for name, r, t in zip(names, ref_tokens, tokens, strict=True):
        assert t == r == CASES[name]["tokens"].tolist(), name
        _check_logp(torch.stack(ref[name]), torch.stack(got[name]), f"{name}, batch of {max_batch or len(names)}")


def test_deepcopy_shares_the_sessions(ort):
    twin = copy.deepcopy(ort)
    a, b = ort.qwen.layers[1].mlp.down_proj, twin.qwen.layers[1].mlp.down_proj
    assert a is not b and a.run is b.run and type(b) is lm_ort.OrtLinear and b.has_bias == a.has_bias
    z = CASES["zero_shot_a"]
    assert _generate(twin, z, [])[0] == z["tokens"].tolist()


def test_live_decoding_equals_fp32(fp32, ort):
    from cosyvoice_triton.models.bistream import live_decode

    for name in ("bistream_chunks", "bistream_runout"):
        with np.load(ORACLE / f"{name}.npz") as f:
            z = {k: f[k] for k in f.files}
        chunks = [z["text"][a:b] for a, b in itertools.pairwise(np.cumsum([0, *z["chunk_sizes"]]))]
        out = {}
        for label, lm in (("fp32", fp32), ("fp32-ort", ort)):
            logps: list = []
            tokens = list(live_decode(lm, chunks, z["prompt_text"], z["prompt_speech_token"],
                                      draws=CountedDraws(z["draws"].tolist()), on_step=lambda s, lp, seen=logps:
                                      seen.append(lp)))
            out[label] = tokens, logps
        assert out["fp32-ort"][0] == out["fp32"][0] == z["tokens"].tolist(), name
        _check_logp(torch.stack(out["fp32"][1]), torch.stack(out["fp32-ort"][1]), name)


def test_the_measured_differences():
    print(f"fp32-ort against fp32, largest log-prob difference: top-{TOP_K} {SEEN['top']:.2e}, whole vector "
          f"{SEEN['vector']:.2e}")
    assert SEEN["top"] <= TOP_BAR


# ---------------------------------------------------------------------------------------- serving it


def test_in_the_served_lm_engine(ort):
    from cosyvoice_triton.serving.stages.lm_engine import LMEngine

    names = sorted(CASES)
    engine = LMEngine(ort, max_active=8, max_waiting=8, wait_timeout_s=PATIENCE_S)
    try:
        jobs = [engine.submit(LMRequest(CASES[n]["text"], CASES[n]["prompt_text"], CASES[n]["prompt_speech_token"],
                                        draws=CASES[n]["draws"].tolist())) for n in names]
        out: list = [None] * len(jobs)

        def run(i):
            out[i] = list(jobs[i].tokens())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S)
        assert out == [CASES[n]["tokens"].tolist() for n in names]
    finally:
        engine.close()


def test_tunables_and_the_served_parameter(tmp_path):
    from cosyvoice_triton.models.demo import write_demo_model
    from cosyvoice_triton.serving.repository import RenderError, Tunables, render_repository
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.params import read_parameters

    param = next(p for p in MODEL_PARAMS["cosyvoice_tts_stream"] if p.name == "lm_precision")
    assert param.choices == lm_quant.LM_PRECISIONS and param.default == Tunables().lm_precision == "fp32"
    assert Tunables(lm_precision="fp32-ort").lm_precision == "fp32-ort"
    with pytest.raises(RenderError, match="lm_precision must be fp32 or int8 .*fp32-ort"):
        Tunables(lm_precision="ort")
    demo = write_demo_model(tmp_path / "tiny", size="tiny", seed=0)
    repo = render_repository("local", tmp_path / "repo", model_dir=demo, allow_missing=True, tts="on",
                             lm_precision="fp32-ort").out_dir
    config = (repo / "cosyvoice_tts_stream" / "config.pbtxt").read_text()
    raw = re.findall(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', config)
    params = {"parameters": {k: {"string_value": v} for k, v in raw}}
    assert read_parameters(params, MODEL_PARAMS["cosyvoice_tts_stream"])["lm_precision"] == "fp32-ort"


def test_tts_service_and_pipeline_with_fp32_ort(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2
    from cosyvoice_triton.serving.stages.tts import TTSService

    md, graphs, wave, t = tts_request(serving_assets)
    answers = {}
    for precision in ("fp32", "fp32-ort"):
        svc = TTSService(md, graphs, lm_precision=precision)
        try:
            assert getattr(svc.lm, "lm_precision", "fp32") == precision
            answers[precision] = np.concatenate([c["waveform"][0] for c in svc.responses(t)])
        finally:
            svc.close()
    # the same tokens, so the same audio (the flow and HiFT are the same graphs)
    assert answers["fp32-ort"].shape == answers["fp32"].shape
    np.testing.assert_allclose(answers["fp32-ort"], answers["fp32"], atol=1e-4)
    model = CosyVoice2.from_pretrained(md, lm_precision="fp32-ort", tts=True)
    assert model.llm.lm_precision == "fp32-ort"
    speech = model.tts("Hello there, this is a test.", prompt_audio=wave, prompt_sr=24000, prompt_text="the prompt",
                       seed=3, stream=True)
    assert speech.size and np.isfinite(speech).all()


# ------------------------------------------------------------------------------------------ bench-tts


def test_bench_roofline_arithmetic(fp32, ort):
    from cosyvoice_triton.bench import tts as bench_tts

    b32, bort = bench_tts.decode_step_bytes(fp32), bench_tts.decode_step_bytes(ort)
    linears = [m for m in (*fp32.qwen.modules(), fp32.llm_decoder) if type(m) is torch.nn.Linear]
    assert b32 == bort == {"shared": sum(p.nbytes for m in linears for p in m.parameters()),
                           "per_token": 4 * fp32.speech_embedding.embedding_dim}
    int8 = bench_tts.decode_step_bytes(lm_quant.quantize_lm(bench_tts.twin_lm(fp32), "int8"))
    assert int8["shared"] < b32["shared"]
    assert type(fp32.qwen.layers[0].mlp.up_proj) is torch.nn.Linear  # the twin shared tensors, not modules
    r = bench_tts.roofline(1e9, {"fp32": {"shared": 1000, "per_token": 10}}, {"fp32": {1: 1e5, 4: 1e5}})
    one, four = r["precisions"]["fp32"]["batches"][1], r["precisions"]["fp32"]["batches"][4]
    assert one["bytes_per_token"] == 1010 and one["ceiling_tokens_per_s"] == pytest.approx(1e9 / 1010)
    assert four["bytes_per_token"] == 260 and four["fraction"] == pytest.approx(1e5 * 260 / 1e9)
    assert bench_tts.copy_bandwidth(1 << 20, rounds=1) > 0


def test_bench_tts_compares_fp32_ort(tmp_path, capsys):
    """A tiny dry run of ``make bench-tts``'s LM part: the figures it writes, not what they are."""
    from cosyvoice_triton.bench import tts as bench_tts
    from cosyvoice_triton.models.demo import write_demo_model

    demo = write_demo_model(tmp_path / "tiny", size="tiny", seed=0)
    out = tmp_path / "bench.json"
    assert bench_tts.main(["--model-dir", str(demo), "--decode-tokens", "6", "--batches", "1,3", "--utterance-s", "0",
                           "--repeats", "1", "--first-chunk-rounds", "0", "--lm-precisions", "fp32,fp32-ort",
                           "--bandwidth-mb", "16", "--out-json", str(out)]) == 0
    r, text = json.loads(out.read_text()), capsys.readouterr().out
    assert r["int8"] is None and {k: v["tokens"] for k, v in r["fp32_ort"]["decode"].items()} == {"1": 5, "3": 15}
    q = r["fp32_ort"]["quality"]
    assert q["steps"] == 7 and q["max_tv"] <= 1e-4 and q["same_token"] == 1.0
    assert re.search(r"fp32-ort LM: decode tokens/s, batch 3: [\d.]+ \(15 tok\), [\d.]+x fp32", text)
    roof = r["roofline"]
    assert roof["bandwidth_bytes_per_s"] > 0 and set(roof["precisions"]) == {"fp32", "fp32-ort"}
    for p in roof["precisions"].values():
        assert set(p["batches"]) == {"1", "3"} and all(b["fraction"] > 0 for b in p["batches"].values())
    assert re.search(r"  fp32-ort: [\d.]+ MB per step \+ [\d.]+ kB per token; batch 1: [\d.]+ of [\d.]+ tokens/s", text)
    with pytest.raises(SystemExit):
        bench_tts.main(["--model-dir", str(demo), "--lm-precisions", "fp32-ort"])
