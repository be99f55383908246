"""The gateway's work on a request body grows linearly with its size, up to the body cap, and one tenant's crafted
body never stalls the others.

- :func:`~cosyvoice_triton.gateway.limits.json_depth` and ``bounded_loads`` on the worst bodies we know (a long
  unclosed string of ``\\"``, runs of backslashes, quotes, brackets, long numbers, many short strings, mixed):
  the depth is checked against a plain reading byte by byte, and the time at 8x the size must stay well below the
  64x a quadratic check takes (ratios of the least CPU time of several runs, never a fixed deadline).
- The real gateway (uvicorn, in a process of its own, on a fake speech backend) under the attack body, 40 KB and at
  the body cap, at ``/v1/audio/speech`` and ``/v2/models/cosyvoice_vc/infer``: a 400 naming the problem, while
  another tenant's ``/health`` and ordinary speech requests keep being answered as fast as the gateway's own
  answer to the attack allows (a small part of it) or near their time alone. The form routes, under form bodies
  whose parsing costs the most per byte, the same way."""

from __future__ import annotations

import json
import random
import re
import statistics
import threading
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from conftest import gateway_running
from test_gateway import _client
from test_gateway_kserve import SIG

from cosyvoice_triton.gateway import GatewayConfig, limits
from cosyvoice_triton.gateway.errors import GatewayError
from cosyvoice_triton.gateway.kserve_http import checked_body
from cosyvoice_triton.gateway.limits import bounded_loads, json_depth
from cosyvoice_triton.gateway.tenants import PUBLIC

CAP = GatewayConfig().max_body_bytes
MAX_DEPTH = GatewayConfig().max_json_depth
#: 8x more bytes must cost well under the 64x of a quadratic check (linear: 8x, plus noise and cache effects).
GROWTH, MOST = 8, 24


def reference_depth(body: bytes) -> int:
    """``json_depth`` read byte by byte: a quote after an odd run of backslashes is escaped, the others open or
    close a string, brackets outside strings count."""
    run, inside, depth, deepest = 0, False, 0, 0
    for c in body:
        if c == 0x22 and run % 2 == 0:
            inside = not inside
        elif not inside and c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not inside and c in b"]}":
            depth -= 1
        run = run + 1 if c == 0x5C else 0
    return deepest


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def regex_depth(body: bytes) -> int:
    """The check as it was (a regex blanks the strings, then the brackets are summed): right, but quadratic on an
    unclosed string; for small valid bodies only."""
    depth = np.cumsum([(c in b"[{") - (c in b"]}") for c in _STRING.sub(b'""', body)] or [0])
    return int(max(depth.max(), 0))


def nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    return 0


def _fill(unit: bytes, n: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    return head + (unit * ((n - len(head) - len(tail)) // len(unit) + 1))[: n - len(head) - len(tail)] + tail


#: Bodies of about ``n`` bytes that cost a pre-parse check the most.
WORST = {
    "unclosed_escaped_quotes": lambda n: _fill(b'\\"', n, b'"'),  # the probe's body
    "unclosed_backslashes": lambda n: _fill(b"\\", n, b'"'),
    "backslash_runs_and_quotes": lambda n: _fill(b'\\\\\\"\\\\"', n, b'["', b'"]'),
    "quotes": lambda n: _fill(b'"', n),
    "long_escapes": lambda n: _fill(b"\\u00e9\\n\\\\", n, b'{"input": "', b'"}'),
    "deep_at_the_cap": lambda n: _fill(b"1,", n, b"[" * MAX_DEPTH + b'"' + b"[" * 100 + b'",', b"1" + b"]" * MAX_DEPTH),
    "too_deep": lambda n: _fill(b"[", n),
    "long_number": lambda n: _fill(b"7", n, b"[", b"]"),
    "short_strings": lambda n: _fill(b'"",', n, b"[", b'""]'),
    "mixed": lambda n: _fill(b'["\\\\\\"[{", {"a": [1, "]}"]}, 12.5e3, ', n, b"[", b"0]"),
    "text_with_escapes": lambda n: _fill(b'x\\"y[', n, b'{"model": "cosyvoice2", "input": "', b'"}'),
}


def best_time(call, body: bytes, repeats: int) -> float:
    """The least CPU time of ``repeats`` calls (this thread's: what other processes run meanwhile does not count)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        call(body)
        best = min(best, time.thread_time() - t0)
    return best


def _loads(body: bytes):
    try:
        return bounded_loads(body, MAX_DEPTH)
    except GatewayError as exc:
        return exc


# ------------------------------------------------------------------------------------------- json_depth itself


@pytest.mark.parametrize("shape", sorted(WORST))
def test_json_depth_of_the_worst_bodies_is_right(shape):
    for n in (1000, 3 * getattr(limits, "_BLOCK", 65536) + 17):  # within one block, and across blocks
        body = WORST[shape](n)
        assert json_depth(body) == reference_depth(body), shape
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return
    assert json_depth(body) == nesting(value) == regex_depth(body)


def test_json_depth_matches_the_reference_on_random_bodies(monkeypatch):
    """Random bytes of the alphabet that matters, each read across blocks of every small size (the state carried
    from one block to the next: inside a string, the depth, a backslash escaping the next block's first byte)."""
    rng = random.Random(7)
    bodies = [bytes(rng.choice(b'"\\[]{}a, ') for _ in range(rng.randint(0, 40))) for _ in range(1000)]
    for block in (1, 2, 3, 5, 8, 64):
        monkeypatch.setattr(limits, "_BLOCK", block)
        for sparse in (8, 10**9):  # the quotes and brackets gathered first, or the whole block
            monkeypatch.setattr(limits, "_SPARSE", sparse)
            for body in bodies:
                assert json_depth(body) == reference_depth(body), (block, sparse, body)


def test_json_depth_equals_the_parsed_nesting_and_the_old_regex():
    rng = random.Random(3)

    def value(depth: int):
        r = rng.random()
        if depth > 7 or r < 0.3:
            return rng.choice([1, 2.5, None, "", "[[{", '\\"]', "\\", '\\\\"{', "é[ü", 'a"b'])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "[", '"', "\\"]) + str(i): value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(3000):
        v = value(0)
        body = json.dumps(v, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(body) == nesting(v) == regex_depth(body), body
    padded = json.dumps({"a": [[["]"]]], "pad": "x" * 300_000, "b": [[[[[1]]]]]}).encode()  # sparse blocks
    assert json_depth(padded) == 6 and json_depth(b"") == 0 and json_depth(b'"') == 0 and json_depth(b"[]]][[") == 1


def test_bodies_json_loads_would_read_as_utf16_are_refused():
    """Their bytes are not what the depth is counted on (a UTF-16 code unit may hold a quote byte)."""
    for enc in ("utf-16", "utf-16-le", "utf-32"):
        exc = _loads(json.dumps({"a": "\u2200", "b": [[1]]}).encode(enc))
        assert isinstance(exc, GatewayError) and exc.status == 400 and exc.code == "invalid_json", enc
    assert _loads(b"\xef\xbb\xbf" + json.dumps({"a": [1]}).encode()) == {"a": [1]}  # a UTF-8 BOM is fine


@pytest.mark.parametrize("shape", sorted(WORST))
def test_the_checks_before_parsing_grow_linearly_up_to_the_body_cap(shape):
    """Each step 8x the bytes, up to the cap: json_depth, and bounded_loads (the check then the parser), stay well
    under the quadratic 64x. Small sizes first, so a quadratic check fails in seconds, not hours."""
    sizes = [CAP // GROWTH**k for k in (4, 3, 2, 1, 0)]  # 2.5 KB ... 10 MB
    before = None
    for n in sizes:
        body = WORST[shape](n)
        repeats = 7 if n < CAP // GROWTH else 3
        times = (best_time(json_depth, body, repeats), best_time(_loads, body, repeats))
        if before is not None:
            for what, t, t0 in zip(("json_depth", "bounded_loads"), times, before, strict=True):
                # below 1 ms the call's fixed cost and timer noise dominate: compare from there
                ratio = t / max(t0, 1e-3)
                assert ratio < MOST, f"{shape}: {what} took {t0 * 1e3:.2f} ms at {n // GROWTH} bytes and " \
                                     f"{t * 1e3:.2f} ms at {n} ({ratio:.1f}x for {GROWTH}x the bytes)"
        before = times


def test_the_probe_body_is_a_400_naming_the_problem():
    exc = _loads(WORST["unclosed_escaped_quotes"](40_001))  # at the cap: through the gateway, below
    assert isinstance(exc, GatewayError) and exc.status == 400 and exc.code == "invalid_json"
    assert "not valid JSON" in exc.message and "Unterminated string" in exc.message
    exc = _loads(WORST["too_deep"](CAP))
    assert exc.code == "json_too_deep" and f"nested {CAP} deep" in exc.message


# ------------------------------------------------------------------------------ the gateway's other per-body work


def test_an_overlong_content_type_is_refused_before_the_form_parser_reads_it():
    """The form parser splits a Content-Type's parameters in quadratic time; a form's is ~100 characters."""
    client, backend = _client()
    r = client.post("/inference_sft", content=b"tts_text=hi&spk_id=alice",
                    headers={"content-type": "application/x-www-form-urlencoded" + ";" * 2000})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_type", r.text
    assert "2033 characters" in r.json()["error"]["message"] and backend.jobs == []
    assert client.post("/inference_sft", data={"tts_text": "hi", "spk_id": "alice"}).status_code == 200


def test_form_bodies_reach_the_routes_whole_in_pieces():
    """A form is handed to its parser in pieces (a turn of the event loop between them): a field across many
    pieces, in both encodings, arrives whole."""
    client, backend = _client(max_input_chars=200_000)
    rng = random.Random(5)
    text = "".join(rng.choice("abc &=+%;\r\n--") for _ in range(100_000))
    assert client.post("/inference_sft", data={"tts_text": text, "spk_id": "alice"}).status_code == 200
    assert backend.jobs[-1].text == text
    r = client.post("/inference_sft", data={"spk_id": "alice"}, files={"tts_text": (None, text.encode())})
    assert r.status_code == 200 and backend.jobs[-1].text == text


def test_unknown_kserve_fields_are_named_as_before_without_sorting_them_all():
    """The first names in order, as a sort of them all gave (a million unknown fields cost no sort of a million)."""
    for count in (1, 3, 300):
        extra = {f"k{i:07d}": 1 for i in range(count, 0, -1)}
        with pytest.raises(GatewayError) as exc:
            checked_body(SIG, json.dumps({"inputs": [], **extra}).encode(), None, PUBLIC, MAX_DEPTH)
        assert exc.value.message == f"the request: unknown field(s) {', '.join(sorted(extra))[:200]}"


# ------------------------------------------------------------------------------------- through the real gateway

#: A script for ``python -c``; it finds the stand-in speech backend beside this file.
SERVER = f"LIVE_DIR = {str(Path(__file__).parent)!r}\n" + r"""
import sys

import uvicorn

from cosyvoice_triton.gateway import GatewayConfig, create_app
from cosyvoice_triton.gateway.inference import Signature
from cosyvoice_triton.gateway.upstream import Upstream

SIG = Signature.from_metadata({
    "name": "cosyvoice_vc",
    "inputs": [{"name": "source_audio", "datatype": "FP32", "shape": ["-1", "-1"]},
               {"name": "source_sample_rate", "datatype": "INT32", "shape": ["-1", "1"]}],
    "outputs": [{"name": "waveform", "datatype": "FP32", "shape": ["-1", "-1"]}]})


async def signature(self, model):  # no Triton behind: the model's metadata as Triton would give them
    self.public(model)
    return SIG


Upstream.signature = signature


sys.path.insert(0, LIVE_DIR)  # tests/live: the stand-in speech backend
from standin_gateway import Backend  # noqa: E402

port = int(sys.argv[1])
backend = Backend()
backend.table["alice"] = 3.0
config = GatewayConfig(port=port, api_keys=frozenset({"attacker-key", "other-key"}))
uvicorn.run(create_app(config, backend), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
"""

ATTACKER = {"authorization": "Bearer attacker-key"}
OTHER = {"authorization": "Bearer other-key"}
SPEECH = {"model": "cosyvoice2", "input": "Hello there.", "voice": "alice", "response_format": "pcm"}
#: The client's patience: far beyond what any answer here takes once the gateway is linear; a quadratic one
#: (hours at the cap) fails on it instead of hanging the run.
PATIENCE_S = 120.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from cosyvoice_triton.serving.launch.server import free_ports

    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with gateway_running(["-c", SERVER, str(port)], log, f"127.0.0.1:{port}"):
        yield f"http://127.0.0.1:{port}"


def _innocent(client: httpx.Client, i: int) -> float:
    """One of another tenant's requests (/health, then an ordinary speech request, in turn): its latency."""
    t0 = time.perf_counter()
    if i % 2:
        r = client.post("/v1/audio/speech", json=SPEECH, headers=OTHER)
    else:
        r = client.get("/health")
    assert r.status_code == 200, r.text[:300]
    return time.perf_counter() - t0


def _under_attack(base: str, path: str, body: bytes, rounds: int, content_type: str):
    """``rounds`` attack requests back to back in a thread, another tenant's requests in a loop meanwhile: the
    attack's answers with their times, and the innocent requests' latencies (those sent while it ran)."""
    answers: list[tuple[httpx.Response | BaseException, float]] = []

    def attack():
        with httpx.Client(base_url=base, timeout=PATIENCE_S) as client:
            for _ in range(rounds):
                t0 = time.perf_counter()
                try:
                    r = client.post(path, content=body, headers={**ATTACKER, "content-type": content_type})
                except httpx.HTTPError as exc:  # a quadratic gateway: past the client's patience
                    answers.append((exc, time.perf_counter() - t0))
                    return
                answers.append((r, time.perf_counter() - t0))

    latencies = []
    with httpx.Client(base_url=base, timeout=PATIENCE_S) as client:
        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
        i = 0
        while thread.is_alive() or not latencies:
            latencies.append(_innocent(client, i))
            i += 1
        thread.join()
    return answers, latencies


def _alone(base: str) -> float:
    with httpx.Client(base_url=base, timeout=PATIENCE_S) as client:
        for i in range(4):  # warm: connections, the first speech request's imports
            _innocent(client, i)
        return statistics.median(_innocent(client, i) for i in range(20))


def _assert_not_stalled(answers, latencies, alone: float) -> None:
    attack_s = statistics.median(t for _, t in answers)
    worst = max(latencies)
    # each innocent request waits at most a small part of the attack's own answer, or a few times its time alone
    assert worst <= max(attack_s / 2, 50 * alone), \
        f"another tenant's request took {worst:.3f} s while the attack was answered in {attack_s:.3f} s " \
        f"(alone: {alone * 1e3:.1f} ms; {len(latencies)} requests)"


@pytest.mark.parametrize("n", [40_001, CAP], ids=["40KB", "cap"])
@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v2/models/cosyvoice_vc/infer"])
def test_the_probe_body_is_refused_without_stalling_other_tenants(gateway, path, n):
    body = WORST["unclosed_escaped_quotes"](n)
    assert len(body) == n
    alone = _alone(gateway)
    answers, latencies = _under_attack(gateway, path, body, rounds=8 if n < CAP else 3,
                                       content_type="application/json")
    for r, _ in answers:
        assert isinstance(r, httpx.Response), f"the attack was not answered: {r!r}"
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        message = error if path.startswith("/v2") else error["message"]
        assert "not valid JSON" in message and "Unterminated string" in message, message
        if not path.startswith("/v2"):
            assert error["code"] == "invalid_json"
    _assert_not_stalled(answers, latencies, alone)


FORMS = {  # form bodies whose parsing costs the most per byte: every byte a separator, or a boundary look-alike
    "urlencoded_separators": (lambda n: _fill(b"&", n, b"spk_id=alice&tts_text=hi"),
                              "application/x-www-form-urlencoded"),
    "multipart_boundary_lookalikes": (
        lambda n: _fill(b"\r\n--Bx", n, b'--B\r\nContent-Disposition: form-data; name="spk_id"\r\n\r\nalice\r\n'
                                        b'--B\r\nContent-Disposition: form-data; name="tts_text"\r\n\r\nhi\r\n'
                                        b'--B\r\nContent-Disposition: form-data; name="x"; filename="x"\r\n\r\n',
                        b"\r\n--B--\r\n"),
        "multipart/form-data; boundary=B"),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_bodies_at_the_cap_do_not_stall_other_tenants(gateway, form):
    make, content_type = FORMS[form]
    body = make(CAP)
    alone = _alone(gateway)
    answers, latencies = _under_attack(gateway, "/inference_sft", body, rounds=1, content_type=content_type)
    for r, _ in answers:
        assert isinstance(r, httpx.Response), f"the form was not answered: {r!r}"
        assert r.status_code in (200, 400), r.text[:300]
    _assert_not_stalled(answers, latencies, alone)
