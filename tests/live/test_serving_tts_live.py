"""The served live TTS model over gRPC (``cosyvoice_tts_live``: one bidirectional stream per session, Triton's
sequence batcher, text pieces in, audio chunks out): the first audio comes before the text has all arrived, each
chunk on the sender of the newest piece when it was computed, and the whole equals ``CosyVoice2.tts_live`` with the
same pieces and seed; invalid UTF-8 split across pieces is refused naming it; text that stops arriving ends the
session after ``live_text_timeout_s`` with what it has."""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, rel_err, served, wait_until
from test_serving_live import Stream

from cosyvoice_triton.serving.stages.live_tts import LIVE_TTS_MODEL

SEED = 3
TEXT_TIMEOUT_S = 6.0
PACE_S = 0.5  # between text pieces (well within the text timeout)
PROMPT_TEXT = "A prompt."
PIECES = ["Hello there, ", "this is ", "a live ", "text to ", "speech ", "test that ", "streams its ", "words ",
          "one by ", "one as ", "they are ", "written."]


@pytest.fixture(scope="module")
def prompt():
    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return wave[: int(1.5 * sr)], sr


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("tts_live") / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], max_queue_delay_us=5000,
                               live_text_timeout_s=TEXT_TIMEOUT_S, live_tts_max_sessions=2)
    assert report.models[LIVE_TTS_MODEL] == "python (decoupled)"
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def reference(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"])


def _voice(prompt) -> dict[str, np.ndarray]:
    wave, sr = prompt
    return {"prompt_audio": wave[None].astype(np.float32), "prompt_sample_rate": np.array([[sr]], np.int32),
            "prompt_text": np.array([[PROMPT_TEXT.encode()]], object), "seed": np.array([[SEED]], np.int64)}


def _text(piece: str | bytes) -> dict[str, np.ndarray]:
    return {"text": np.array([[piece.encode() if isinstance(piece, str) else piece]], object)}


def _sessions(server) -> float:
    from cosyvoice_triton.loadtest.metrics import parse_prometheus

    with urllib.request.urlopen(server.metrics_url, timeout=30) as r:
        series = parse_prometheus(r.read().decode())
    return sum(s.value for s in series
               if s.name == "cosyvoice_live_sessions" and s.labels.get("model") == LIVE_TTS_MODEL)


def _collect(s, seen: list, n_requests):
    """Until each of ``n_requests`` has its final response or an error (the events ``seen`` already first):
    ({rid: [outputs]}, errors, {rid: final time})."""
    outs, errors, finals = {}, [], {}
    seen = list(seen)
    while len(finals) + len(errors) < n_requests:
        t, result, error = seen.pop(0) if seen else s.events.get(timeout=PATIENCE_S)
        if error is not None:
            errors.append(error.message())
            continue
        r = result.get_response()
        if r.outputs:
            outs.setdefault(r.id, []).append({o.name: result.as_numpy(o.name) for o in r.outputs})
        if r.parameters["triton_final_response"].bool_param:
            finals[r.id] = t
    return outs, errors, finals


def _chunks(outs):
    return sorted((int(o["chunk_index"].ravel()[0]), rid, o) for rid, os in outs.items() for o in os)


# ------------------------------------------------------------------------------------------ rendered config
@pytest.mark.parametrize("flavor", ["local", "onnx", "trt"])
def test_the_live_tts_model_is_rendered_with_a_sequence_batcher(serving_assets, tmp_path, flavor):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from cosyvoice_triton.serving.repository import RenderError, render_repository
    from cosyvoice_triton.serving.stages.live_tts import LIVE_TTS_INPUTS, LIVE_TTS_OUTPUTS
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.params import read_parameters

    out = tmp_path / "repo"
    render_repository(flavor, out, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      allow_missing=True, live_tts_max_sessions=3, live_text_timeout_s=2.5,
                      live_tts_max_token_text_ratio=12.0)
    cfg = text_format.Parse((out / LIVE_TTS_MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 1
    assert cfg.sequence_batching.oldest.max_candidate_sequences == 6
    assert cfg.sequence_batching.max_sequence_idle_microseconds == int(7.5e6)
    assert not cfg.HasField("dynamic_batching")
    assert [i.name for i in cfg.input] == [t.name for t in LIVE_TTS_INPUTS]
    assert [o.name for o in cfg.output] == [t.name for t in LIVE_TTS_OUTPUTS] and cfg.output[-1].name == "text_pieces"
    p = read_parameters(json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
                        MODEL_PARAMS[LIVE_TTS_MODEL], model=LIVE_TTS_MODEL)
    assert (p["max_sessions"], p["text_timeout_s"], p["max_token_text_ratio"]) == (3, 2.5, 12.0)
    with pytest.raises(RenderError, match="live_text_timeout_s"):
        render_repository(flavor, tmp_path / "bad", model_dir=serving_assets["model_dir"],
                          onnx_dir=serving_assets["onnx_dir"], allow_missing=True, live_text_timeout_s=0.0)
    off = render_repository(flavor, tmp_path / "off", model_dir=serving_assets["model_dir"],
                            onnx_dir=serving_assets["onnx_dir"], allow_missing=True, tts="off")
    assert LIVE_TTS_MODEL not in off.models  # rendered with the TTS models only


# ------------------------------------------------------------------------------------------------ live gRPC
def test_text_streamed_in_pieces_is_spoken_as_it_arrives_and_equals_the_library(server, prompt, reference):
    s = Stream(server, 201, model=LIVE_TTS_MODEL)
    events, sent_at_first_audio = [], None
    try:
        for k, piece in enumerate(PIECES):
            s.send({**(_voice(prompt) if k == 0 else {}), **_text(piece)}, start=k == 0)
            if sent_at_first_audio is None:  # paced like a writer while no audio has come
                time.sleep(PACE_S)
                while not s.events.empty():
                    events.append(s.events.get_nowait())
                if any(r is not None and r.get_response().outputs for _, r, _ in events):
                    sent_at_first_audio = k + 1
        s.send(_text(b""), end=True)
        outs, errors, _ = _collect(s, events, len(PIECES) + 1)
    finally:
        s.close()
    assert not errors, errors
    assert sent_at_first_audio is not None and sent_at_first_audio < len(PIECES)  # audio before the text's end
    chunks = _chunks(outs)
    assert [c[0] for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
    # each chunk went on the sender of the newest piece when it was computed (p<k>: piece k + 1 received)
    for _, rid, o in chunks:
        assert int(o["text_pieces"].ravel()[0]) == int(rid[1:]) + 1, rid
    assert int(chunks[0][2]["text_pieces"].ravel()[0]) <= sent_at_first_audio
    wave, sr = prompt
    want = list(reference.tts_live(PIECES, prompt_audio=wave, prompt_sr=sr, prompt_text=PROMPT_TEXT, seed=SEED))
    assert len(chunks) == len(want)
    for (_, _, o), w in zip(chunks, want, strict=True):
        assert int(o["sample_rate"].ravel()[0]) == 24000 and o["waveform"][0].shape == w.shape
        assert rel_err(o["waveform"][0], w) < 1e-3
    wait_until(lambda: _sessions(server) == 0, "the ended session freed")


@pytest.mark.parametrize("pieces, want", [
    ([b"Hello \xe4\xbd", b"\xa0 and \xe4", b"A world."], "invalid UTF-8 at byte 14 of the stream"),
    ([b"Hello there \xe4\xbd"], "text ends inside a UTF-8 character"),
])
def test_invalid_utf8_across_pieces_is_refused_naming_it(server, prompt, pieces, want):
    s = Stream(server, 202, model=LIVE_TTS_MODEL)
    try:
        for k, piece in enumerate(pieces):
            s.send({**(_voice(prompt) if k == 0 else {}), **_text(piece)}, start=k == 0)
        s.send(_text(b""), end=True)
        _, errors, _ = _collect(s, [], len(pieces) + 1)
    finally:
        s.close()
    assert any(e.startswith("INVALID_ARGUMENT: ") and want in e for e in errors), errors
    wait_until(lambda: _sessions(server) == 0, "the failed session freed")


def test_text_that_stops_arriving_ends_after_the_timeout_with_what_it_has(server, prompt, reference):
    text = "Hello there, this is a live text that stops."
    s = Stream(server, 203, model=LIVE_TTS_MODEL)
    try:
        sent = time.monotonic()
        s.send({**_voice(prompt), **_text(text)}, start=True)  # and no END
        wait_until(lambda: _sessions(server) == 1, "the session counted while it waits for text")
        outs, errors, finals = _collect(s, [], 1)
        late = s.send(_text(b""), end=True)
        _, late_errors, _ = _collect(s, [], 1)
    finally:
        s.close()
    assert not errors and "p0" in finals, errors
    assert finals["p0"] - sent >= TEXT_TIMEOUT_S  # it waited for more text first
    chunks = _chunks(outs)
    wave, sr = prompt
    want = list(reference.tts_live([text], prompt_audio=wave, prompt_sr=sr, prompt_text=PROMPT_TEXT, seed=SEED))
    assert len(chunks) == len(want) >= 1
    for (_, _, o), w in zip(chunks, want, strict=True):
        assert o["waveform"][0].shape == w.shape and rel_err(o["waveform"][0], w) < 1e-3
    assert late == "p1" and any("idle timeout" in e for e in late_errors), late_errors
    wait_until(lambda: _sessions(server) == 0, "the timed-out session freed")
