"""Text from the client is text UTF-8 can carry, at every route that sends it on to Triton: a lone surrogate (JSON's
``"\\ud800"``) or bytes that are not UTF-8 are the client's input, refused with 400 (HTTP) or INVALID_ARGUMENT
(gRPC) naming the field, never passed on for the backend to fail on (a 503 clients would retry)."""

from __future__ import annotations

import pytest
from test_gateway import GOOD, _client, _openai_error
from test_gateway_kserve import SIG, _grpc_refused, _grpc_request, _json, _refused

from cosyvoice_triton.gateway.errors import GatewayError
from cosyvoice_triton.gateway.inference import Signature, encode_bytes
from cosyvoice_triton.gateway.kserve_http import checked_body
from cosyvoice_triton.gateway.tenants import PUBLIC

LONE = "\\ud800"  # as JSON escapes it


@pytest.mark.parametrize("field,extra", [("input", {}), ("instructions", {}),
                                         ("reference_text", {"reference_audio": "UklGRg==", "voice": None}),
                                         ("voice", {})])
def test_speech_refuses_a_lone_surrogate_naming_the_field(field, extra):
    client, backend = _client()
    body = {**GOOD, **extra, field: "hi SURROGATE"}
    raw = __import__("json").dumps(body).replace("SURROGATE", LONE).encode()
    err = _openai_error(client.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"}),
                        400, param=field)
    assert "surrogate" in err["message"] or field == "voice"
    assert backend.jobs == []


def test_voice_object_id_with_a_lone_surrogate_is_refused():
    client, backend = _client()
    raw = __import__("json").dumps({**GOOD, "voice": {"id": "SURROGATE"}}).replace("SURROGATE", LONE).encode()
    _openai_error(client.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"}),
                  400, param="voice")
    assert backend.jobs == []


@pytest.mark.parametrize("path,field,data", [
    ("/inference_sft", "tts_text", {"spk_id": "alice"}),
    ("/inference_sft", "spk_id", {"tts_text": "Hi."}),
])
def test_forms_refuse_text_that_is_not_utf8(path, field, data):
    client, backend = _client()
    # percent-encoded bytes of a surrogate and a stray continuation byte: the form parser must not hand them on
    for bad in ("%ED%A0%80", "%FF"):
        body = "&".join([f"{k}={v}" for k, v in data.items()] + [f"{field}=hi{bad}"])
        r = client.post(path, content=body, headers={"content-type": "application/x-www-form-urlencoded"})
        if r.status_code == 200:  # decoded with replacement characters: text, harmless
            assert "\ufffd" in (backend.jobs[-1].text if field == "tts_text" else backend.jobs[-1].voice)
        else:
            _openai_error(r, 400, param=field)
    sep = "XyZ"
    parts = [f'--{sep}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in data.items()]
    parts.append(f'--{sep}\r\nContent-Disposition: form-data; name="{field}"\r\n\r\n'.encode() + b"hi \xed\xa0\x80\r\n")
    body = b"".join(parts) + f"--{sep}--\r\n".encode()
    n = len(backend.jobs)
    r = client.post(path, content=body, headers={"content-type": f"multipart/form-data; boundary={sep}"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        _openai_error(r, 400, param=field)
    else:
        job = backend.jobs[-1]
        assert len(backend.jobs) == n + 1
        (job.text if field == "tts_text" else job.voice).encode()  # whatever got through is UTF-8 text


def test_kserve_json_lone_surrogate_is_refused_naming_the_input():
    sig = Signature.from_metadata({"name": "cosyvoice_tts", "inputs": [
        {"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]}], "outputs": []})
    body = b'{"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi \\ud800"]}]}'
    with pytest.raises(GatewayError) as exc:
        checked_body(sig, body, None, PUBLIC, 16)
    assert exc.value.status == 400 and exc.value.param == "text" and "surrogate" in exc.value.message
    bad = _json([{"name": "speaker_id", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]).replace(b'"x"',
                                                                                                     b'"\\ud800"')
    _refused(bad, "speaker_id")


def test_kserve_binary_text_must_be_utf8_but_an_encoded_file_need_not():
    sig = Signature.from_metadata({"name": "cosyvoice_tts", "inputs": [
        {"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]},
        {"name": "prompt_audio_bytes", "datatype": "BYTES", "shape": ["-1", "1"]}], "outputs": []})

    def body(text: bytes, audio: bytes = b"RIFF\xff\xfe") -> tuple[bytes, str]:
        head = _json([{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                       "parameters": {"binary_data_size": 4 + len(text)}},
                      {"name": "prompt_audio_bytes", "shape": [1, 1], "datatype": "BYTES",
                       "parameters": {"binary_data_size": 4 + len(audio)}}])
        return head + encode_bytes([text]) + encode_bytes([audio]), str(len(head))

    for ok in ("héllo".encode(), "日本".encode()[:-1], "日本".encode()[1:]):  # a character cut at an end: a live piece
        checked_body(sig, *body(ok)[:1], body(ok)[1], PUBLIC, 16)
    for wrong in (b"hi \xed\xa0\x80 there", b"hi \xff there", b"a\xc3(b"):
        with pytest.raises(GatewayError) as exc:
            checked_body(sig, body(wrong)[0], body(wrong)[1], PUBLIC, 16)
        assert exc.value.status == 400 and exc.value.param == "text", exc.value.message


def test_grpc_bytes_contents_and_raw_text_must_be_utf8():
    for raw in (True, False):
        req = _grpc_request(raw=raw)
        t = req.inputs.add(name="speaker_id", datatype="BYTES", shape=[1, 1])
        value = b"al\xed\xa0\x80ice"
        if raw:
            req.raw_input_contents.append(encode_bytes([value]))
        else:
            t.contents.bytes_contents.append(value)
        _grpc_refused(req, "speaker_id", "UTF-8")
    assert SIG.inputs["speaker_id"].datatype == "BYTES"


def test_a_form_of_separators_is_refused_before_the_form_parser():
    """The form parser skips each extra ``&`` in Python (a log call each): a body of separators at the cap held the
    event loop for seconds. More than ``MAX_FORM_SEPARATORS`` are refused at once, naming the count; a form with a
    few extra separators is still parsed."""
    from cosyvoice_triton.gateway.middleware import MAX_FORM_SEPARATORS

    client, backend = _client()
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = "spk_id=alice&tts_text=Hi." + "&" * MAX_FORM_SEPARATORS
    r = client.post("/inference_sft", content=body, headers=form)
    assert r.status_code == 400 and f"{MAX_FORM_SEPARATORS + 1} '&' separators" in r.text, r.text
    assert backend.jobs == []
    r = client.post("/inference_sft", content="spk_id=alice&&tts_text=Hi.&&", headers=form)
    assert r.status_code != 400 or "separators" not in r.text, r.text
    assert backend.jobs and backend.jobs[-1].text == "Hi."
