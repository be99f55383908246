"""The prompt cache: bounds, keys, thread safety; a repeated prompt skips the front end, the tokenizer and CAM++
in process (CosyVoice2) and served (preprocess's Preprocessor, compute_prompt) with bit-identical results."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES

from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.pipeline import CosyVoice2
from cosyvoice_triton.prompt_cache import PromptCache, prompt_cache_totals, prompt_key
from cosyvoice_triton.serving.stages.frontend import Preprocessor
from cosyvoice_triton.serving.stages.speakers import compute_prompt

SOURCE = FIXTURES / "source_en_5s.wav"
PROMPT = FIXTURES / "prompt_en_3s.wav"


def _entry(n_floats: int, value: float = 0.0) -> dict[str, np.ndarray]:
    return {"a": np.full(n_floats, value, np.float32)}


# ------------------------------------------------------------------------------------------- the cache itself

def test_lru_by_entries_keeps_the_recently_used():
    cache = PromptCache(max_entries=3, max_bytes=1 << 20)
    for k in "abc":
        cache.put(k, _entry(4))
    assert cache.get("a") is not None  # a becomes the most recent: b is now the oldest
    cache.put("d", _entry(4))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert len(cache) == 3
    s = cache.stats()
    assert s["evictions"] == 1 and s["hits"] == 1 and s["misses"] == 0 and s["entries"] == 3


def test_lru_by_bytes_and_oversized_entries():
    entry_bytes = 1000 * 4
    cache = PromptCache(max_entries=100, max_bytes=3 * entry_bytes + 3 * 256)
    for i in range(5):
        cache.put(str(i), _entry(1000, i))
    assert len(cache) == 3 and [str(i) in cache for i in range(5)] == [False, False, True, True, True]
    assert cache.stats()["bytes"] <= cache.max_bytes
    huge = cache.put("huge", _entry(10_000))  # larger than the whole cache: returned, not kept
    assert huge["a"].shape == (10_000,) and "huge" not in cache and len(cache) == 3


def test_entries_are_read_only_copies_and_misses_are_counted():
    cache = PromptCache()
    before = prompt_cache_totals()
    source = _entry(3, 1.0)
    kept = cache.put("k", source)
    source["a"][0] = 5.0  # the caller's array changes: the entry does not
    assert kept["a"][0] == 1.0 and not kept["a"].flags.writeable
    with pytest.raises(ValueError):
        kept["a"][0] = 2.0
    assert cache.get("missing") is None and cache.get("k") is kept
    after = prompt_cache_totals()
    assert after["misses"] - before["misses"] >= 1 and after["hits"] - before["hits"] >= 1
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1


def test_bounds_hold_under_concurrent_use():
    cache = PromptCache(max_entries=8, max_bytes=6 * (400 + 256))
    computed = []
    errors = []

    def worker(seed: int):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                k = int(rng.integers(0, 20))
                entry = cache.get_or_compute(str(k), lambda k=k: computed.append(k) or _entry(100, k))
                assert entry["a"][0] == k
                assert len(cache) <= 8
        except Exception as e:  # collected: an assert in a thread does not fail the test by itself
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    assert s["entries"] <= 6 and s["bytes"] <= cache.max_bytes  # the byte bound is the tighter one here
    assert s["hits"] + s["misses"] == 6 * 300 and s["misses"] == len(computed) > 20


def test_key_covers_audio_rate_kind_and_options():
    rng = np.random.default_rng(0)
    wave = rng.standard_normal(16000).astype(np.float32)
    key = prompt_key(wave, 16000, kind="k", options={"vad": False, "model": "m"})
    assert key == prompt_key(wave.copy(), 16000, kind="k", options={"model": "m", "vad": False})
    assert key == prompt_key(np.repeat(wave, 2)[::2], 16000, kind="k", options={"vad": False, "model": "m"})
    changed = wave.copy()
    changed[1234] = np.nextafter(changed[1234], np.float32(np.inf))  # one sample, one ulp
    others = [prompt_key(changed, 16000, kind="k", options={"vad": False, "model": "m"}),
              prompt_key(wave, 22050, kind="k", options={"vad": False, "model": "m"}),
              prompt_key(wave, 16000, kind="other", options={"vad": False, "model": "m"}),
              prompt_key(wave, 16000, kind="k", options={"vad": True, "model": "m"}),
              prompt_key(wave, 16000, kind="k", options={"vad": False, "model": "m2"}),
              prompt_key(wave.astype(np.float64), 16000, kind="k", options={"vad": False, "model": "m"})]
    assert len({key, *others}) == 7


# ------------------------------------------------------------------------------------------------ in process

class _Counting:
    """Wraps a method and counts its calls (the encoder calls a cache hit must skip)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)


@pytest.fixture
def counted(demo_dir, monkeypatch):
    model = CosyVoice2.from_pretrained(demo_dir, prompt_cache=PromptCache(max_entries=4))
    tok, emb = _Counting(model.tokenizer.tokenize), _Counting(model.speaker.embed)
    monkeypatch.setattr(model.tokenizer, "tokenize", tok)
    monkeypatch.setattr(model.speaker, "embed", emb)
    return model, tok, emb


def test_repeated_prompt_skips_tokenizer_and_speaker_encoder(counted, demo_dir):
    model, tok, emb = counted
    first = model.frontend_vc(SOURCE, PROMPT)
    assert (tok.calls, emb.calls) == (2, 1)  # source and prompt tokenized, prompt embedded
    samples, rate = sf.read(PROMPT, dtype="float32")
    again = model.frontend_vc(SOURCE, samples, prompt_sr=rate)  # the same audio as samples: the same entry
    assert (tok.calls, emb.calls) == (3, 1)  # only the source
    for name in ("source_tokens", "prompt_tokens", "prompt_mel", "embedding"):
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
    assert model.prompt_cache.stats()["hits"] == 1 and model.prompt_cache.stats()["misses"] == 1
    # the TTS prompt of the same recording comes from the same entry, equal to an uncached computation
    speaker = model.prompt(PROMPT)
    assert (tok.calls, emb.calls) == (3, 1)
    plain = CosyVoice2.from_pretrained(demo_dir, prompt_cache=False).prompt(PROMPT)
    for name in ("prompt_tokens", "prompt_mel", "embedding"):
        np.testing.assert_array_equal(getattr(speaker, name), getattr(plain, name))


def test_changed_prompt_and_eviction_recompute(counted):
    model, _, emb = counted
    samples, rate = sf.read(PROMPT, dtype="float32")
    model.frontend_vc(SOURCE, samples, prompt_sr=rate)
    model.frontend_vc(SOURCE, samples * 0.5, prompt_sr=rate)  # other samples: a new entry
    model.frontend_vc(SOURCE, samples[: rate * 2], prompt_sr=rate)
    assert emb.calls == 3 and len(model.prompt_cache) == 3
    for i in range(3):  # push the first out (max_entries=4)
        model.frontend_vc(SOURCE, samples * (0.9 - 0.1 * i), prompt_sr=rate)
    assert emb.calls == 6 and len(model.prompt_cache) == 4 and model.prompt_cache.stats()["evictions"] == 2
    model.frontend_vc(SOURCE, samples, prompt_sr=rate)
    assert emb.calls == 7  # evicted: computed again


def test_repeated_prompt_converts_bit_identically(counted):
    model, _, emb = counted
    first = model.convert(SOURCE, PROMPT, seed=3)
    second = model.convert(SOURCE, PROMPT, seed=3)
    assert emb.calls == 1
    np.testing.assert_array_equal(second, first)


# --------------------------------------------------------------------------------------------------- served

def _graphs(model: CosyVoice2):
    """The two graphs as the served models answer them, run here by the in-process onnxruntime sessions."""
    tok = _Counting(lambda t: {"speech_tokens": model.tokenizer.tokenize(t["whisper_mel"], t["whisper_mel_len"])[0]})
    emb = _Counting(lambda t: {"speaker_embedding": model.speaker.embed(t["fbank"])})
    return {"speech_tokenizer": tok, "speaker_encoder": emb}


def test_compute_prompt_hit_skips_front_end_and_graphs(demo_dir, monkeypatch):
    model = CosyVoice2.from_pretrained(demo_dir, prompt_cache=False)
    graphs = _graphs(model)
    pre = Preprocessor(model.config.mel, sample_rate=model.config.sample_rate, prompt_cache=PromptCache(),
                       model_id=str(demo_dir))
    features = _Counting(pre.prompt_features)
    monkeypatch.setattr(pre, "prompt_features", features)
    samples, rate = sf.read(PROMPT, dtype="float32")
    audio = (samples[None], np.array([[rate]], np.int32), None)
    first = compute_prompt(pre, graphs, audio, token_mel_ratio=2)
    encoded = (None, None, np.array([[PROMPT.read_bytes()]], dtype=object))  # the same audio as a wav file
    second = compute_prompt(pre, graphs, encoded, token_mel_ratio=2)
    assert features.calls == 1 and graphs["speech_tokenizer"].calls == 1 and graphs["speaker_encoder"].calls == 1
    for name in ("prompt_tokens", "prompt_mel", "embedding"):
        np.testing.assert_array_equal(getattr(second, name), getattr(first, name))
    plain = model.prompt(PROMPT)  # the in-process prompt: the same as the served one
    np.testing.assert_array_equal(first.prompt_tokens, plain.prompt_tokens)
    np.testing.assert_allclose(first.prompt_mel, plain.prompt_mel, rtol=0, atol=1e-6)


def test_preprocess_hit_is_identical_and_options_make_other_entries(demo_dir, monkeypatch):
    from cosyvoice_triton.config import ModelConfig

    cfg = ModelConfig.from_yaml(demo_dir / "cosyvoice2.yaml")
    cache = PromptCache()
    plain = Preprocessor(cfg.mel, prompt_cache=cache, model_id="m")
    denoised = Preprocessor(cfg.mel, prompt_cache=cache, denoise_prompt=True, model_id="m")
    src, src_sr = sf.read(SOURCE, dtype="float32")
    prm, prm_sr = sf.read(PROMPT, dtype="float32")
    args = (src[None], [[src_sr]], prm[None], [[prm_sr]])
    calls = _Counting(plain.prompt_features)
    monkeypatch.setattr(plain, "prompt_features", calls)
    a, b = plain.one(*args), plain.one(*args)
    assert calls.calls == 1 and len(cache) == 1
    for name, value in a.tensors().items():
        np.testing.assert_array_equal(b.tensors()[name], value)
    c = denoised.one(*args)
    assert len(cache) == 2  # denoising changes the features: its own entry
    assert not np.array_equal(c.prompt_fbank, a.prompt_fbank)
    np.testing.assert_array_equal(c.source_whisper_mel, a.source_whisper_mel)
    uncached = Preprocessor(cfg.mel).one(*args)
    for name, value in uncached.tensors().items():
        np.testing.assert_array_equal(a.tensors()[name], value)


def test_vc_stream_prompt_hit_skips_features_and_graphs(demo_dir, monkeypatch):
    from cosyvoice_triton.serving.stages.flow import FlowSolver
    from cosyvoice_triton.serving.stages.vc_stream import VCStreamer

    model = CosyVoice2.from_pretrained(demo_dir, prompt_cache=False)
    graphs = {**_graphs(model), **{g: _Counting(lambda t: None) for g in
                                   ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")}}
    solver = FlowSolver(model.config.flow.cfm, token_mel_ratio=model.config.token_mel_ratio)
    pre = Preprocessor(model.config.mel, sample_rate=model.config.sample_rate, prompt_cache=PromptCache(),
                       model_id=str(demo_dir))
    features = _Counting(pre.prompt_features)
    monkeypatch.setattr(pre, "prompt_features", features)
    streamer = VCStreamer(pre, solver, graphs)
    src, ssr = sf.read(SOURCE, dtype="float32")
    prm, psr = sf.read(PROMPT, dtype="float32")

    def request(source):
        return {"source_audio": source[None], "source_sample_rate": np.array([[ssr]], np.int32),
                "prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32)}

    first, tokens, _ = streamer.prepare(request(src))
    second, _, _ = streamer.prepare(request(src[: len(src) // 2]))
    assert features.calls == 1 and graphs["speaker_encoder"].calls == 1
    assert graphs["speech_tokenizer"].calls == 3  # the prompt once, each source
    uncached = VCStreamer(Preprocessor(model.config.mel, sample_rate=model.config.sample_rate), solver, graphs)
    plain, plain_tokens, _ = uncached.prepare(request(src))
    np.testing.assert_array_equal(plain_tokens, tokens)
    for name in ("prompt_tokens", "prompt_mel", "embedding"):
        np.testing.assert_array_equal(getattr(second, name), getattr(first, name))
        np.testing.assert_array_equal(getattr(plain, name), getattr(first, name))


# ------------------------------------------------------------------------------ Triton's response cache (render)

def test_response_cache_rendered_on_the_prompt_graphs_and_passed_to_the_server(demo_dir, tmp_path):
    from cosyvoice_triton.serving.launch.server import TritonInstallation, response_cache_flags
    from cosyvoice_triton.serving.repository import RESPONSE_CACHE_GRAPHS, render_repository

    root = tmp_path / "triton"  # never run: the flags only need its root
    inst = TritonInstallation(root=root, binary=root / "bin" / "tritonserver", backends=root / "backends",
                              stub=root / "backends" / "python" / "stub", libs=None, bundled=False)
    on = render_repository("local", tmp_path / "on", model_dir=demo_dir, allow_missing=True, tts="off",
                           response_cache_mb=16).out_dir
    for g in ("speech_tokenizer", "speaker_encoder", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder"):
        text = (on / g / "config.pbtxt").read_text()
        assert ("response_cache { enable: true }" in text) == (g in RESPONSE_CACHE_GRAPHS)
    assert response_cache_flags(on, inst) == [f"--cache-config=local,size={16 << 20}",
                                              f"--cache-directory={tmp_path / 'triton' / 'caches'}"]
    off = render_repository("local", tmp_path / "off", model_dir=demo_dir, allow_missing=True, tts="off",
                            response_cache_mb=0).out_dir
    plain = render_repository("local", tmp_path / "plain", model_dir=demo_dir, allow_missing=True, tts="off",
                              profile="plain").out_dir
    for repo in (off, plain):  # the plain baseline deploys no cache
        assert all("response_cache" not in (repo / g / "config.pbtxt").read_text() for g in RESPONSE_CACHE_GRAPHS)
        assert response_cache_flags(repo, inst) == []
    assert response_cache_flags(tmp_path, inst) == []  # not a rendered repository
    default = render_repository("local", tmp_path / "default", model_dir=demo_dir, allow_missing=True,
                                tts="off").out_dir
    # opt in only: Triton 2.51 caches error answers too (a refused request's bytes would later get an empty success)
    assert all("response_cache" not in (default / g / "config.pbtxt").read_text() for g in RESPONSE_CACHE_GRAPHS)
    assert response_cache_flags(default, inst) == []


def test_repeated_speaker_load_test_plan_and_figures():
    from cosyvoice_triton.loadtest.repeated import counts, plan_requests, render_markdown, summarize

    rng = np.random.default_rng(1)
    sources = [rng.standard_normal(8000).astype(np.float32) for _ in range(3)]
    plan = plan_requests(12, 4, sources, [16000] * 3, seed=0)
    assert len({r.source.tobytes() for r in plan}) == 12  # no source repeats: only prompts can hit
    assert [r.prompt for r in plan] == [r.prompt for r in plan_requests(12, 4, sources, [16000] * 3, seed=0)]
    assert {r.prompt for r in plan} <= set(range(4))

    def stats(hits: int, misses: int, inferences: int) -> dict:
        st = {"success": {"count": 12, "ns": 0}, "cache_hit": {"count": hits, "ns": 0},
              "cache_miss": {"count": misses, "ns": 0}, "compute_input": {"ns": 1_000_000},
              "compute_infer": {"ns": 2_000_000}, "compute_output": {"ns": 0}}
        return {"model_stats": [{"name": "speaker_encoder", "version": "1", "inference_count": inferences,
                                 "execution_count": inferences, "inference_stats": st},
                                {"name": "flow", "version": "1", "inference_count": 1, "inference_stats": st}]}

    wave = np.ones(10, np.float32)
    records = [{"index": r.index, "latency_s": 1.0 + r.index, "ok": True, "waveform": wave} for r in plan]
    on, off = counts(stats(9, 3, 3)), counts(stats(0, 0, 12))
    assert set(on) == {"speaker_encoder"} and on["speaker_encoder"]["compute_ns"] == 3_000_000
    changed = [dict(r, waveform=wave * 2) if r["index"] == 5 else r for r in records]
    report = summarize({"on": {"records": records, "wall_s": 6.0, "stats": on},
                        "off": {"records": changed, "wall_s": 12.0, "stats": off}}, plan, 4)
    assert report["modes"]["on"]["prompt_hit_rate"] == 9 / 12 and report["modes"]["off"]["prompt_hit_rate"] == 0
    assert report["modes"]["on"]["speaker_encoder_inferences_per_request"] == 3 / 12
    assert report["modes"]["on"]["throughput_rps"] == 2.0 and report["modes"]["on"]["p50_ms"] == 6500.0
    assert report["identical"] == {"compared": 12, "differ": 1, "max_rel_err": 0.5}
    assert "1 differ (max rel err 5.00e-01)" in render_markdown(report)
